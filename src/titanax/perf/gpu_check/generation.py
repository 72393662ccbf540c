"""What a GPU generation cannot run, asked of the kernel tables in one place: every section
records such a case as `n/a` with this reason, never as a failure (an H200 is the only GPU we
are lent: a case that cannot run on Hopper must not fail its loan).

The reasons come from the tables the dispatch itself reads (flash_attention/backends.py,
fp8/backends.py), so a kernel added there is judged here without an edit.
tests/test_gpu_check_generations.py runs every section's case list as it would be on compute
capability 9.0 and 10.0 and traces each case that is not n/a. No jax import here.
"""

from __future__ import annotations

from pallas_kernels.flash_attention.backends import backend
from pallas_kernels.fp8.backends import RECIPES_TABLE, matmul, mx_refusal

_WHAT = {9: "wgmma", 10: "tcgen05"}


def attention_refusal(impl: str, major: int) -> str | None:
    """Why attention backend `impl` cannot run on a GPU of compute capability major.x."""
    need = backend(impl).compute_capability
    if need is not None and need != major:
        return (f"{impl} needs compute capability {need}.x ({_WHAT.get(need, 'its MMA')}), "
                f"this GPU is {major}.x")
    return None


def fp8_refusal(impl: str, mode: str, cc: tuple[int, int]) -> str | None:
    """Why fp8_matmul(impl) with `mode` scales cannot run on a GPU of compute capability cc:
    another generation's kernel, a scaling it does not take, MX scales before Blackwell (XLA's
    too: fp8_matmul refuses them there), or a CPU-only kernel."""
    m = matmul(impl)
    if m.compute_capability is not None and m.compute_capability != cc[0]:
        return (f"{impl} needs compute capability {m.compute_capability}.x "
                f"({_WHAT.get(m.compute_capability, 'its MMA')}), this GPU is {cc[0]}.{cc[1]}")
    if mode not in m.scalings:
        return f"{impl} takes {'/'.join(m.scalings)} scales, not {mode}"
    if mode == "mx" and (why := mx_refusal(cc)):
        return why
    if not m.gpu_kernel:
        return f"{impl} is the CPU (interpret-mode) kernel, refused on a GPU"
    return None


def recipe_refusal(precision: str, cc: tuple[int, int] | None) -> str | None:
    """Why execution.matmul_precision=precision cannot train on this GPU (MX before
    Blackwell); None for the non-FP8 precisions and off a GPU."""
    recipe = RECIPES_TABLE.get(precision)
    if recipe is None or cc is None or recipe.scaling != "mx":
        return None
    return mx_refusal(cc)
