"""Matmuls as the model calls them: parameters stay in param_dtype, compute runs in dtype.

`precision` comes from execution.matmul_precision: 'default' multiplies in the compute dtype with
float32 accumulation where the backend does so; 'highest' asks for full-precision passes;
'fp8_tensorwise', 'fp8_delayed', 'fp8_rowwise' and 'mxfp8' run the product as FP8 GEMMs
through pallas_kernels.fp8.fp8_linear (e4m3 forward; gradients e5m2 for the tensorwise recipes,
e4m3 for fp8_rowwise and mxfp8), flattened to one 2-D matmul [tokens, in] x [in, out]. Call sites that must stay in
the compute dtype whatever the recipe (the output layer) pass fp8=False.
`mxfp8_scale_rounding` (execution.mxfp8_scale_rounding) picks mxfp8's scale exponents: 'up' never
clips a block's max, 'floor' is the OCP rule (pallas_kernels/fp8/quant.py). On a GPU the FP8
GEMMs are cuBLASLt's (tensorwise and rowwise; forward with fast accumulation, dgrad and wgrad without:
pallas_kernels/fp8/accumulation.py) or cuDNN's block-scaled GEMM (mxfp8, Blackwell only).

Specs: 'AK,KB->AB' (w's contracted axes first: w is [in, out]) or 'AK,BK->AB' (contracted axes
last: w is [out, in], the torch Linear layout), e.g. 'bsd,dhk->bshk' and 'bshk,dhk->bsd'. The
second form is how wo and w_down are stored: FSDP shards 'embed', and a weight whose sharded
axis is its major one is all-gathered (and its gradient reduce-scattered) in place, where an
embed-last weight made XLA:GPU keep a transposed copy of the whole stacked parameter.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.fp8.backends import RECIPES as FP8_RECIPES  # plain data: no kernels loaded
from pallas_kernels.fp8.backends import RECIPES_TABLE, mx_refusal
from pallas_kernels.target import compute_capability
from titanax.parallel import collective_matmul as cm

_PRECISION = {"default": None, "highest": jax.lax.Precision.HIGHEST}


def precision_refusal(matmul_precision: str) -> str | None:
    """Why the GPU this process runs on cannot run execution.matmul_precision (mxfp8 before
    Blackwell: no block-scaled MMA), or None. Checked before anything is built, so the run
    stops with one line instead of a traceback from inside the first trace."""
    recipe = RECIPES_TABLE.get(matmul_precision)
    if recipe is None or recipe.scaling != "mx":
        return None
    why = mx_refusal(compute_capability())
    return f"execution.matmul_precision={matmul_precision}: {why}" if why else None


def _split_spec(spec: str) -> tuple[str, str, str, bool]:
    """'bsd,dhk->bshk' -> ('bs', 'd', 'hk', False); 'bshk,dhk->bsd' -> ('bs', 'hk', 'd', True):
    x's kept axes, the contracted axes, w's kept axes, and whether w holds its contracted axes
    last. Every product runs as one 2-D matmul, so x = kept + contracted and w = contracted +
    kept ('AK,KB->AB') or kept + contracted ('AK,BK->AB')."""
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    contracted = "".join(c for c in xs if c in ws and c not in out)
    x_keep = xs[:len(xs) - len(contracted)]
    if contracted and xs == x_keep + contracted:
        first, last = ws[len(contracted):], ws[:len(ws) - len(contracted)]
        for w_keep, w_last in ((first, False), (last, True)):
            w_order = w_keep + contracted if w_last else contracted + w_keep
            if ws == w_order and out == x_keep + w_keep:
                return x_keep, contracted, w_keep, w_last
    raise ValueError(f"linear needs a spec of the form 'AK,KB->AB' or 'AK,BK->AB' (contracted "
                     f"axes last in x, in the same order first or last in w), got {spec!r}")


def linear(x, w, spec: str, *, precision: str = "default", dtype=jnp.bfloat16,
           fp8: bool = True, fp8_meta=None, grad_reduce: str = "compute",
           mxfp8_scale_rounding: str = "up", tp: str | None = None):
    """einsum(spec, x, w) with both operands cast to the compute dtype, or FP8 GEMMs when
    precision names an FP8 recipe and fp8 is True. fp8_meta: the call site's amax histories
    ({'x', 'w', 'g'}), needed by 'fp8_delayed' only. grad_reduce: 'compute' (the weight
    gradient is a compute-dtype dot, so FSDP reduce-scatters it in the compute dtype) or
    'float32' (accumulated and reduced in float32; not for the FP8 GEMMs, whose recipes fix
    their own gradient dtypes). tp: the call site's tensor-parallel role, 'column' or 'row'
    (None: neither); inside parallel.collective_matmul.use_collective_matmul() such a
    compute-dtype product of x [B, S, ...] runs as a collective matmul."""
    x_keep, contracted, _, w_last = _split_spec(spec)
    lead = x.shape[:len(x_keep)]
    k = math.prod(x.shape[len(x_keep):])
    tail = w.shape[:w.ndim - len(contracted)] if w_last else w.shape[len(contracted):]
    if precision in FP8_RECIPES and fp8:
        from pallas_kernels.fp8 import fp8_linear  # the kernels package loads on first FP8 use

        # fp8_linear takes w [I, O]: an [O, I] weight passes this layer's transpose. Activations
        # arrive in the compute dtype; weights are quantized straight from the float32 master
        # copy (no detour through bf16 rounding).
        w_IO = w.reshape(-1, k).T if w_last else w.reshape(k, -1)
        y = fp8_linear(x.astype(dtype).reshape(-1, k), w_IO,
                       fp8_meta if RECIPES_TABLE[precision].delayed else None,
                       recipe=precision, out_dtype=dtype,
                       mxfp8_scale_rounding=mxfp8_scale_rounding)
        return y.reshape(*lead, *tail)
    if precision in FP8_RECIPES:  # an excluded call site: plain compute-dtype matmul
        precision = "default"
    if precision not in _PRECISION:
        raise ValueError(f"unknown matmul precision {precision!r}; use one of "
                         f"{list(_PRECISION) + list(FP8_RECIPES)}")
    # One 2-D GEMM [tokens, in] x [in, out] (or x [out, in]^T, contracting w's minor dimension;
    # cuBLAS takes a transposed operand as it is): XLA:CPU runs the backward of the 3-D/4-D
    # einsum (two contracted axes for dW) about 1.5x slower than the same product flattened
    # (docs/performance.md); on GPU both lower to the same cuBLAS call.
    w2 = w.reshape(-1, k) if w_last else w.reshape(k, -1)
    f32_wgrad = grad_reduce == "float32" and jnp.dtype(dtype) != jnp.float32
    if _rings(x, x_keep, tp):
        (y,) = _ring_products(x, (w2,), k, len(x_keep), w_last, precision,
                              jnp.dtype(dtype), f32_wgrad, tp)
        return y.reshape(*lead, *tail)
    x2 = x.astype(dtype).reshape(-1, k)
    if f32_wgrad:
        y = _dot_f32_wgrad(x2, w2, w_last, precision, jnp.dtype(dtype))
    else:
        y = _dot(x2, w2.astype(dtype), w_last, precision)
    return y.reshape(*lead, *tail)


def linears(x, ws, spec: str, *, fp8_metas=None, **kw) -> tuple:
    """linear(x, w, spec, **kw) for each w of ws (one input, several weights: q/k/v, gate/up).
    A column-parallel group under a collective matmul shares one ring: the input's sequence
    chunks go round once for all weights, and in the backward the summed input gradient is
    reduce-scattered once. fp8_metas: each weight's amax histories (fp8_delayed)."""
    metas = (None,) * len(ws) if fp8_metas is None else tuple(fp8_metas)
    x_keep, contracted, _, w_last = _split_spec(spec)
    precision = kw.get("precision", "default")
    if (kw.get("tp") != "column" or len(ws) == 1 or not _rings(x, x_keep, kw["tp"])
            or precision not in _PRECISION):  # FP8 GEMMs and plain layouts: one by one
        return tuple(linear(x, w, spec, fp8_meta=m, **kw) for w, m in zip(ws, metas))
    lead, dtype = x.shape[:len(x_keep)], jnp.dtype(kw.get("dtype", jnp.bfloat16))
    k = math.prod(x.shape[len(x_keep):])
    tails = [w.shape[:w.ndim - len(contracted)] if w_last else w.shape[len(contracted):]
             for w in ws]
    w2s = [w.reshape(-1, k) if w_last else w.reshape(k, -1) for w in ws]
    f32_wgrad = kw.get("grad_reduce", "compute") == "float32" and dtype != jnp.float32
    ys = _ring_products(x, w2s, k, len(x_keep), w_last, precision, dtype, f32_wgrad, "column")
    return tuple(y.reshape(*lead, *tail) for y, tail in zip(ys, tails))


def _rings(x, x_keep: str, tp: str | None) -> bool:
    """Whether this product runs as a collective matmul: a tensor-parallel call site of an
    [B, S, ...] input inside use_collective_matmul(), on a layout the ring handles."""
    return (tp in cm.ROLES and cm.active() and len(x_keep) == 2
            and cm.applies(x.shape[1]))


def _ring_products(x, w2s, k, n_keep, w_last, precision, dtype, f32_wgrad, tp) -> list:
    """parallel.collective_matmul of x [B, S, I] with the 2-D weights w2s: [B, S, O] each.
    Its weight gradients are summed in float32 and come back in each w2's dtype: the compute
    dtype, or (f32_wgrad) the parameters' own."""
    x3 = x.astype(dtype).reshape(*x.shape[:n_keep], k)
    return cm.collective_matmul(x3, [w2 if f32_wgrad else w2.astype(dtype) for w2 in w2s], tp,
                                w_last=w_last, precision=_PRECISION[precision])


def _dot(x2, w2, w_last: bool, precision: str, **kw):
    dims = (((1,), (1,)) if w_last else ((1,), (0,)), ((), ()))
    return jax.lax.dot_general(x2, w2, dims, precision=_PRECISION[precision], **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dot_f32_wgrad(x2, w2, w_last, precision, dtype):
    """x2 @ w2 in the compute dtype whose weight gradient is accumulated and returned in
    float32 (execution.grad_reduce_dtype=float32): the partial sums that FSDP reduce-scatters are
    float32, where autodiff's compute-dtype dot makes XLA reduce them in the compute dtype."""
    return _dot(x2, w2.astype(dtype), w_last, precision)


def _dot_f32_wgrad_fwd(x2, w2, w_last, precision, dtype):
    return _dot_f32_wgrad(x2, w2, w_last, precision, dtype), (x2, w2)


def _dot_f32_wgrad_bwd(w_last, precision, dtype, res, dy):
    x2, w2 = res
    dx = _dot(dy, w2.astype(dtype), not w_last, precision)  # dy [rows, O] . w [I, O]^T or [O, I]
    dw = _dot(x2.T, dy, False, precision, preferred_element_type=jnp.float32)  # [I, O]
    return dx.astype(x2.dtype), (dw.T if w_last else dw).astype(w2.dtype)


_dot_f32_wgrad.defvjp(_dot_f32_wgrad_fwd, _dot_f32_wgrad_bwd)


# --- delayed scaling state ------------------------------------------------------------------

from flax import nnx  # noqa: E402


class Fp8Meta(nnx.Variable):
    """fp8_delayed amax histories of one call site: [layers, 3 (x, w, grad), history] float32,
    stacked like the weights so the layer scan slices them (logical axes ('layers', None,
    None): sharded and pipeline-staged with the layer stack).

    Its own Variable type, not an nnx.Param: the train state splits the model by type
    (nnx.split by train/roles.py's table) and keeps these as the statistic role's variables,
    beside the weights, so the optimizer never sees them (no Adam moments, no weight decay, not
    in the gradient norm), while checkpoints, sharding, eval and sampling carry them. The
    train step differentiates the loss with respect to them too: fp8_linear's custom VJP
    returns each call site's updated history as its "gradient" (pallas_kernels/fp8/linear.py),
    and that is the new state (combined over microbatches by `max_histories`)."""


def make_fp8_meta(n_layers: int, history: int) -> Fp8Meta:
    return Fp8Meta(jnp.zeros((n_layers, 3, history), jnp.float32),
                   out_sharding=("layers", None, None))


def fp8_meta_dict(meta):
    """[3, history] (one layer's slice) -> the {'x', 'w', 'g'} that fp8_linear takes."""
    return None if meta is None else {"x": meta[0], "w": meta[1], "g": meta[2]}


def max_histories(a, b):
    """The new histories of two microbatches of one step (train.grad_accum) combined: their
    elementwise maximum. Every microbatch returns the same history shifted by one with its own
    amax in front, so the maximum records the largest amax of the step, as one big batch would
    (a sum, or a mean, would record their average and under-scale the next steps). NaN
    propagates through maximum, so count_nonfinite_amax still sees it."""
    return jax.tree.map(jnp.maximum, a, b)


def count_nonfinite_amax(histories) -> jax.Array:
    """int32 count of non-finite amaxes recorded this step: the newest entry ([..., 0]) of
    every history in `histories` (the step's new fp8 state). scale_from_amax would turn such
    an amax into a unit scale for the whole history window; the train step skips the step
    instead (train/step.py). (The fp8 state stays in device memory under train.offload_*.)"""
    counts = [jnp.sum(~jnp.isfinite(v[..., 0]), dtype=jnp.int32)
              for v in jax.tree.leaves(histories)]
    return sum(counts, jnp.zeros((), jnp.int32))
