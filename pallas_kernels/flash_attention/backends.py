"""THE table of flash attention backends: name -> implementation and what it needs.

Everything that names an attention backend reads this table: the kernel dispatch (api.py),
`auto` (resolve.py), titanax's config validation (model.attention_impl), titanax.ops.attention
and the planner. Adding a backend is one kernel file plus one entry in BACKENDS.

Plain data on purpose: titanax.config imports it to validate names without loading jax, so
implementations are named as "module:function" strings and imported on first use (load()).
"""

from __future__ import annotations

import dataclasses
import importlib

_HERE = __name__.rpartition(".")[0]  # pallas_kernels.flash_attention


def load(ref: str):
    """The object a "module:attribute" reference names (module relative to this package when
    it starts with a dot)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module, _HERE if module.startswith(".") else None),
                   attr)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention backend.

    fwd/bwd/pad_multiples: "module:function" of a Pallas kernel pair, called by api.py with
    padded inputs (see kernel_fwd.flash_fwd for the signature); None for backends that are not
    our kernels (cuDNN, the XLA reference), which api.py calls directly. A backend with a
    kernel pair has its own backward (custom_vjp) and runs per device shard (XLA cannot
    partition a Pallas call), and runs on a CPU in a Pallas interpreter (interpret=True).
    """

    name: str
    summary: str
    fwd: str | None = None
    bwd: str | None = None
    pad_multiples: str | None = None  # (q multiple, kv multiple) of a FlashConfig
    config_family: str | None = None  # default FlashConfig key (config.py)
    compute_capability: int | None = None  # the GPU generation (major) it is written for
    dtypes: tuple[str, ...] | None = None  # input dtypes it takes; None: any
    head_dims: tuple[int, ...] | None = None  # None: any
    mosaic: bool = False  # Mosaic GPU: block sizes in multiples of 64 (FlashConfig.check_mosaic)
    in_shard_map: bool = True  # compiles inside a jax.shard_map body (a pipeline stage)
    dense_segment_mask: bool = False  # segment ids become a dense [S, T] mask
    lse_log2: bool = False  # the kernel's log-sum-exp is in log2 units (exp2 softmax)

    def __post_init__(self):
        refs = (self.fwd, self.bwd, self.pad_multiples, self.config_family)
        if any(r is None for r in refs) and any(r is not None for r in refs):
            raise ValueError(f"backend {self.name!r}: fwd, bwd, pad_multiples and "
                             "config_family come together (a Pallas kernel pair) or not at all")
        if self.compute_capability is not None and not self.is_kernel:
            raise ValueError(f"backend {self.name!r}: a GPU generation is for our kernels")

    @property
    def is_kernel(self) -> bool:
        """One of our Pallas kernels: own backward, per-shard, interpretable on CPU."""
        return self.fwd is not None

    def unsupported(self, dtype_name: str, head_dim: int) -> str | None:
        """Why this backend cannot take inputs of this dtype and head_dim, or None."""
        if self.dtypes is not None and dtype_name not in self.dtypes:
            return (f"{self.name} needs {'/'.join(_SHORT.get(d, d) for d in self.dtypes)} "
                    f"(wgmma/tcgen05 operands), got {dtype_name}")
        if self.head_dims is not None and head_dim not in self.head_dims:
            *first, last = (str(d) for d in self.head_dims)
            return f"{self.name} needs head_dim {', '.join(first)} or {last}, got {head_dim}"
        return None


_SHORT = {"bfloat16": "bf16", "float16": "fp16"}
_MOSAIC = dict(dtypes=("bfloat16", "float16"), head_dims=(64, 128, 256), mosaic=True,
               lse_log2=True)

BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("xla", "the jnp reference (reference.py); XLA partitions it"),
    # cuDNN's fused attention keeps XLA's partitioning rule, which fails to compile inside
    # jax.shard_map; packed documents reach it as a dense [S, T] mask.
    Backend("cudnn", "jax.nn.dot_product_attention (cuDNN on GPU, XLA elsewhere)",
            in_shard_map=False, dense_segment_mask=True),
    Backend("triton", "Pallas grid kernel (Triton on GPU; the interpret-mode path on CPU)",
            fwd=".kernel_fwd:flash_fwd", bwd=".kernel_bwd:flash_bwd",
            pad_multiples=".kernel_fwd:pad_multiples", config_family="triton"),
    Backend("mosaic_sm90", "Hopper: TMA + wgmma, warp-specialized (FA3-style)",
            fwd=".kernel_sm90:flash_fwd", bwd=".kernel_sm90_bwd:flash_bwd",
            pad_multiples=".kernel_sm90:pad_multiples", config_family="sm90",
            compute_capability=9, **_MOSAIC),
    Backend("mosaic_sm100", "Blackwell: TMA + tcgen05 with scores and accumulator in TMEM",
            fwd=".kernel_sm100:flash_fwd", bwd=".kernel_sm100_bwd:flash_bwd",
            pad_multiples=".kernel_sm100:pad_multiples", config_family="sm100",
            compute_capability=10, **_MOSAIC),
)}

# Roles `auto` (resolve.py) gives backends, by name.
CPU_DEFAULT = "xla"  # no Pallas GPU kernels off a GPU
INTERPRET_DEFAULT = "triton"  # auto with interpret=True
GPU_VENDOR = "cudnn"  # the GPU default until measured.py records ours faster
GPU_FALLBACK = "triton"  # where the vendor path cannot go and no generation kernel fits

IMPLS = ("auto", *BACKENDS)  # what flash_attention(impl=...) and model.attention_impl take
KERNEL_IMPLS = tuple(n for n, b in BACKENDS.items() if b.is_kernel)
assert {CPU_DEFAULT, INTERPRET_DEFAULT, GPU_VENDOR, GPU_FALLBACK} <= set(BACKENDS)


def backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown flash attention impl {name!r}; use one of {IMPLS}") from None


def generation_kernels(cc_major: int) -> list[Backend]:
    """Our kernels written for this GPU generation, in table order."""
    return [b for b in BACKENDS.values() if b.compute_capability == cc_major]
