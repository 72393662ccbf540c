"""THE table of flash attention backends: name -> implementation and what it needs.

Everything that names an attention backend reads this table: the dispatch (api.py), `auto`
(resolve.py), titanax's config validation (execution.attention_impl), titanax.ops.attention, the
planner and the backend suite (backend_suite_test.py). Adding a backend is one file plus one
entry in BACKENDS: a `backend_<name>.py` whose function has Backend.run's signature
(backend_xla.py, backend_cudnn.py), or a Pallas kernel file with flash_fwd, flash_bwd and
pad_multiples and a kernel_pair(...) entry.

Plain data on purpose: titanax.config imports it to validate names without loading jax, so
implementations are named as "module:function" strings and imported on first use (load()).
The dispatch shape (table, XLA reference, auto, lookup) is the one pallas_kernels/dispatch.py
gives every kernel op.
"""

from __future__ import annotations

import dataclasses

from ..dispatch import impl_names, loader, lookup

load = loader(__name__.rpartition(".")[0])  # relative to pallas_kernels.flash_attention


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention backend: the one function that runs it and what it needs.

    run: "module:function" called by api.py for every call that reaches this backend, with
    the one signature every backend has:
        run(q [B, S, H, K], k [B, T, N, K], v, mask: mask.Mask, *, softmax_scale: float,
            impl: str, config: FlashConfig | None, interpret: bool) -> out [B, S, H, K]
    (differentiable; config and interpret are for our kernels and may be ignored).
    block_fwd / block_bwd: one block of context parallelism's blockwise attention (the
    contract of api.flash_block_fwd / _bwd); None: it cannot be one (no shard_map).

    Our Pallas kernel pairs (entries made by kernel_pair()) also name fwd/bwd/pad_multiples:
    their run is pair.py's custom_vjp around them; they run per device shard (XLA cannot
    partition a Pallas call) and, on a CPU, in a Pallas interpreter (interpret=True).
    """

    name: str
    summary: str
    run: str
    block_fwd: str | None = None
    block_bwd: str | None = None
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
    general_masks: bool = True  # takes any Mask: decoding offsets, other keys' segment ids
    same_sharding: bool = False  # XLA partitions it only with q, k, v sharded alike
    lse_log2: bool = False  # the kernel's log-sum-exp is in log2 units (exp2 softmax)

    def __post_init__(self):
        refs = (self.fwd, self.bwd, self.pad_multiples, self.config_family)
        if any(r is None for r in refs) and any(r is not None for r in refs):
            raise ValueError(f"backend {self.name!r}: fwd, bwd, pad_multiples and "
                             "config_family come together (a Pallas kernel pair) or not at all")
        if self.compute_capability is not None and not self.is_kernel:
            raise ValueError(f"backend {self.name!r}: a GPU generation is for our kernels")
        if (self.block_fwd is None) != (self.block_bwd is None):
            raise ValueError(f"backend {self.name!r}: block_fwd and block_bwd come together")

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


def kernel_pair(name: str, summary: str, module: str, *, bwd_module: str | None = None,
                config_family: str, **needs) -> Backend:
    """The entry of a Pallas kernel pair: `module` (relative, e.g. ".kernel_fwd") defines
    flash_fwd, pad_multiples and (unless bwd_module does) flash_bwd; pair.py runs them."""
    return Backend(name, summary, run=".pair:attention", block_fwd=".pair:block_fwd",
                   block_bwd=".pair:block_bwd", fwd=f"{module}:flash_fwd",
                   bwd=f"{bwd_module or module}:flash_bwd",
                   pad_multiples=f"{module}:pad_multiples", config_family=config_family,
                   general_masks=False, **needs)


_SHORT = {"bfloat16": "bf16", "float16": "fp16"}
_MOSAIC = dict(dtypes=("bfloat16", "float16"), head_dims=(64, 128, 256), mosaic=True,
               lse_log2=True)

BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("xla", "the jnp reference (backend_xla.py); XLA partitions it",
            run=".backend_xla:attention", block_fwd=".backend_xla:block_reference_fwd",
            block_bwd=".backend_xla:block_reference_bwd"),
    # cuDNN's fused attention keeps XLA's partitioning rule, which fails to compile inside
    # jax.shard_map; packed documents reach it as a dense [S, T] mask.
    Backend("cudnn", "jax.nn.dot_product_attention (cuDNN on GPU, XLA elsewhere)",
            run=".backend_cudnn:attention", in_shard_map=False, dense_segment_mask=True,
            same_sharding=True),
    kernel_pair("triton", "Pallas grid kernel (Triton on GPU; the interpret-mode path on CPU)",
                ".kernel_fwd", bwd_module=".kernel_bwd", config_family="triton"),
    kernel_pair("mosaic_sm90", "Hopper: TMA + wgmma, warp-specialized (FA3-style)",
                ".kernel_sm90", bwd_module=".kernel_sm90_bwd", config_family="sm90",
                compute_capability=9, **_MOSAIC),
    kernel_pair("mosaic_sm100", "Blackwell: TMA + tcgen05 with scores and accumulator in TMEM",
                ".kernel_sm100", bwd_module=".kernel_sm100_bwd", config_family="sm100",
                compute_capability=10, **_MOSAIC),
)}

# Roles `auto` (resolve.py) gives backends, by name.
CPU_DEFAULT = "xla"  # no Pallas GPU kernels off a GPU
INTERPRET_DEFAULT = "triton"  # auto with interpret=True
GPU_VENDOR = "cudnn"  # the GPU default until measured.py records ours faster
GPU_FALLBACK = "triton"  # where the vendor path cannot go and no generation kernel fits
GENERAL = "xla"  # any Mask (decoding) that the chosen backend cannot take; the reference

IMPLS = impl_names(BACKENDS)  # what flash_attention(impl=...) and execution.attention_impl take
KERNEL_IMPLS = tuple(n for n, b in BACKENDS.items() if b.is_kernel)
assert {CPU_DEFAULT, INTERPRET_DEFAULT, GPU_VENDOR, GPU_FALLBACK, GENERAL} <= set(BACKENDS)
assert BACKENDS[GENERAL].general_masks


def backend(name: str) -> Backend:
    return lookup(BACKENDS, name, lambda n: f"unknown flash attention impl {n!r}; use one of "
                                            f"{impl_names(BACKENDS)}")


def generation_kernels(cc_major: int) -> list[Backend]:
    """Our kernels written for this GPU generation, in table order."""
    return [b for b in BACKENDS.values() if b.compute_capability == cc_major]
