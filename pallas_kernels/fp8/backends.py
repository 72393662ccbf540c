"""THE tables of FP8 training: the recipes (what execution.matmul_precision names) and the
fp8_matmul implementations (name -> kernel and what it needs).

Everything that names an FP8 recipe or matmul impl reads these: fp8_matmul's dispatch
(api.py), `auto` (resolve.py), fp8_linear, titanax's config validation and
titanax.ops.linear. Adding a matmul kernel is one kernel file plus one entry in MATMULS.

Plain data on purpose: titanax.config imports it without loading jax, so implementations are
"module:function" strings imported on first use (load()). The dispatch shape (table, XLA
reference, auto, lookup) is the one pallas_kernels/dispatch.py gives every kernel op.
"""

from __future__ import annotations

import dataclasses

from ..dispatch import impl_names, loader, lookup

load = loader(__name__.rpartition(".")[0])  # relative to pallas_kernels.fp8


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An FP8 training recipe (fp8_linear; linear.py explains each)."""

    name: str
    # 'tensorwise' (one scale per tensor), 'rowwise' (one per row of each operand, along
    # the contraction) or 'mx' (e8m0 per 32 elements)
    scaling: str
    delayed: bool = False  # scales from amax histories of earlier steps (needs meta)

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"recipe {self.name!r}: scaling {self.scaling!r} not in {SCALINGS}")


SCALINGS = ("tensorwise", "rowwise", "mx")
# The measured.py op name each scaling mode's matmul is benchmarked under.
MEASURED_OP = {"tensorwise": "fp8_tensorwise", "rowwise": "fp8_rowwise", "mx": "mxfp8"}

RECIPES_TABLE: dict[str, Recipe] = {r.name: r for r in (
    Recipe("fp8_tensorwise", "tensorwise"),
    Recipe("fp8_delayed", "tensorwise", delayed=True),
    Recipe("fp8_rowwise", "rowwise"),
    Recipe("mxfp8", "mx"),
)}
RECIPES = tuple(RECIPES_TABLE)
# MX scale exponent: 'up' = ceil(log2(amax / fmax)) (NVIDIA / TE, never clips the block max),
# 'floor' = floor(log2 amax) - emax (OCP MX v1.0; may saturate the block max). quant.py.
MX_SCALE_ROUNDINGS = ("up", "floor")
# The XLA flags the FP8 GEMMs need on a GPU (titanax/xla_flags.py puts them in every GPU run
# and deviceless compile): XLA's Triton GEMMs never promote an FP8 accumulator, whatever the
# dot's precision, so the per-GEMM accumulation of accumulation.py holds on cuBLASLt only.
# Every dot then runs on cuBLAS(Lt), as the deviceless compile shows it.
XLA_GPU_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)

# MX scales need the tensor core to apply them (block-scaled MMA): Blackwell, compute
# capability 10.0, is the first GPU with it. On Hopper XLA would dequantize to float32 and
# run loop-fused dots, so an MX GEMM there is refused (mx_refusal).
BLOCK_SCALED_MMA_CC = 10


def mx_refusal(cc: tuple[int, int] | None) -> str | None:
    """The one-line error for MX scaling (recipe 'mxfp8') on a GPU of compute capability cc,
    None where it runs (Blackwell or later, or no GPU target: cc None). fp8_matmul raises it
    at trace time, launch.plan before compiling."""
    if cc is None or cc[0] >= BLOCK_SCALED_MMA_CC:
        return None
    name = " (Hopper)" if cc[0] == 9 else ""
    return (f"mxfp8 (MX block scales) needs Blackwell's block-scaled MMA (compute capability "
            f"{BLOCK_SCALED_MMA_CC}.0+) and the target GPU is {cc[0]}.{cc[1]}{name}: use "
            "execution.matmul_precision=fp8_tensorwise, fp8_delayed or fp8_rowwise there")


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One fp8_matmul implementation.

    run: "module:function" called as run(a, a_scale, b, b_scale, out_dtype, **kw) where b is
    [K, N], or B transposed [N, K] (and its MX scales transposed; rowwise scales as the
    vectors a_scale [M] and b_scale [N]) when k_major_b.
    config: "module:Class" of its frozen knob dataclass, passed as config= (default: Class()).
    supported: "module:function" (m, n, k, config) -> bool: whether it takes the shape.
    interpret: how it runs without a GPU: 'grid' (interpret=bool, the Pallas grid
    interpreter), 'mosaic' (interpret=plgpu.InterpretGPUParams or None) or None (it does not).
    """

    name: str
    summary: str
    run: str
    scalings: tuple[str, ...] = SCALINGS
    compute_capability: int | None = None  # the GPU generation (major) it is written for
    k_major_b: bool = False
    config: str | None = None
    supported: str | None = None
    interpret: str | None = None
    gpu_kernel: bool = True  # False: refused on a GPU (interpret mode on CPU only)
    # True: run takes gemm= ('fprop', 'dgrad' or 'wgrad') and sets that GEMM's accumulation
    # from accumulation.FAST_ACCUMULATION.
    takes_gemm: bool = False

    def __post_init__(self):
        if not set(self.scalings) <= set(SCALINGS):
            raise ValueError(f"matmul {self.name!r}: scalings {self.scalings} not in {SCALINGS}")
        if self.interpret not in (None, "grid", "mosaic"):
            raise ValueError(f"matmul {self.name!r}: interpret={self.interpret!r}")
        if self.compute_capability is not None and self.supported is None:
            raise ValueError(f"matmul {self.name!r}: a GPU generation's kernel says which "
                             "shapes it takes (supported=)")


MATMULS: dict[str, Matmul] = {m.name: m for m in (
    Matmul("xla", "XLA's FP8 dot (cuBLASLt FP8 GEMM; cuDNN block-scaled GEMM for MX)",
           run=".reference:fp8_matmul_xla", takes_gemm=True),
    Matmul("reference", "jnp upcast-and-dot (reference.py)",
           run=".reference:fp8_matmul_reference"),
    # Its Triton build spills (23 KB per thread at 128x128x128) and cannot load e8m0 MX
    # scales (docs/fp8.md): a CPU-test kernel only.
    Matmul("pallas_grid", "the portable Pallas grid kernel (matmul_grid.py)",
           run=".matmul_grid:fp8_matmul_grid", config=".config:GridConfig", interpret="grid",
           gpu_kernel=False),
    Matmul("sm90", "the Hopper Mosaic GPU wgmma kernel (tensorwise and rowwise)",
           run=".matmul_sm90:fp8_matmul_sm90", scalings=("tensorwise", "rowwise"),
           compute_capability=9,
           k_major_b=True, config=".config:Sm90Config", supported=".matmul_sm90:supported",
           interpret="mosaic"),
    Matmul("sm100", "the Blackwell block-scaled tcgen05 kernel (MX only)",
           run=".matmul_sm100:fp8_matmul_sm100", scalings=("mx",), compute_capability=10,
           k_major_b=True, config=".config:Sm100Config", supported=".matmul_sm100:supported"),
)}

# Roles `auto` (resolve.py) gives implementations, by name.
VENDOR = "xla"  # the GPU default until measured.py records ours faster; also off a GPU
INTERPRET_DEFAULT = "pallas_grid"  # auto with interpret=True
IMPLS = impl_names(MATMULS)  # what fp8_matmul(impl=...) takes
assert {VENDOR, INTERPRET_DEFAULT} <= set(MATMULS)


def matmul(name: str) -> Matmul:
    return lookup(MATMULS, name, lambda n: f"unknown fp8_matmul impl {n!r}; use one of "
                                           f"{list(IMPLS)}")


def generation_kernels(cc_major: int, scaling: str) -> list[Matmul]:
    """Our kernels written for this GPU generation that take this scaling mode."""
    return [m for m in MATMULS.values()
            if m.compute_capability == cc_major and scaling in m.scalings]
