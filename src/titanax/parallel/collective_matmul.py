"""Collective matmul: the sequence-parallel all-gather before each column-parallel matmul and
the reduce-scatter after each row-parallel one, cut into 'tensor'-ring steps that run beside
the GEMMs (TorchTitan's async TP, MaxText's collective matmul, NeMo's TP overlap).

Why not XLA's own (`--xla_gpu_threshold_for_windowed_einsum_mib`, titanax/xla_flags.py): it
never sees our sequence sharding (ops/linear multiplies [B*S, I] GEMMs), and where it would,
with the batch also sharded (data, fsdp), its all-gather loop is the 'partial' kind whose
permutes run synchronously in a conditional. docs/parallelism.md has the HLO evidence
(`python -m launch.bench tp_overlap`).

Inside jax.shard_map manual over 'tensor' (batch and FSDP shardings stay XLA's), device r of tp,
sequence chunks of s = S / tp:
- column (x [B, s, I] per device, weights [I, O_j / tp], one input shared by q/k/v or
  gate/up): step t multiplies the chunk held now, (r + t) mod tp, while passing it on to r - 1.
  Backward: dW_j = gathered x^T dy_j (the gathered x is the forward's residual), and dx is
  reduce-scattered the row way, each partial the sum over the weights.
- row (x [B, S, I / tp], weight [I / tp, O]): step t computes the partial product of chunk
  (r + t + 1) mod tp and adds it to the running sum received from r + 1 while that travels;
  after tp steps device r holds the whole sum of chunk r. Backward: dy chunks go round the
  column way, each step computing its dx chunk and adding to dW.
With context parallelism (mesh 'context' cp > 1) the sequence-parallel activations are split over
('context', 'tensor'), context major: each context shard's S / cp tokens are cut again over
'tensor'. The shard_maps are then manual over 'context' too, with the sequence specs
('context', 'tensor') (split) and 'context' (gathered), so the same tensor ring runs inside
every context shard on its own S / cp tokens (s = S / (cp tp)); the ring never crosses
'context'. Each context shard's weight gradients cover its own tokens only: they leave the
shard_map stacked over 'context' and are summed outside (XLA reduces them onto the weights'
fsdp x context sharding; a psum inside a partly manual shard_map aborts XLA:CPU,
parallel/pipeline_1f1b.py).

Every step is one unit (`_step`: an optimization barrier over what was sent and what was
computed), else XLA's dot merger fuses the GEMMs of several steps into one that waits for the
last chunk. Forward and backward are separate shard_maps under a custom VJP: JAX cannot
differentiate a shard_map nested in a pipeline stage's (parallel/per_shard.py says the same),
and they run without its varying-axes check (`_like` says why).

`use_collective_matmul()` turns it on for the model code traced inside it (ops.linear asks
`active()`; execution.tp_overlap enters it for the train step's loss, train/step.py); it applies
to sequence-parallel layouts (mesh 'tensor' > 1, the sequence divisible by context x tp; a
decoding step falls back to XLA's partitioning), with or without context parallelism, in gpipe
and circular pipeline stages too, but not under the 1f1b schedule nor with the FP8 recipes
(`unsupported`; titanax.config refuses execution.tp_overlap there).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.target import match_varying
from titanax.config import tp_overlap_unsupported

AXIS = "tensor"
CONTEXT = "context"  # manual beside AXIS when > 1: one ring per context shard
ROLES = ("column", "row")  # column: gathers the sequence before; row: scatters it after

_ACTIVE = contextvars.ContextVar("titanax_collective_matmul", default=False)


@contextlib.contextmanager
def use_collective_matmul(on: bool = True):
    """Model code traced inside this block runs its tensor-parallel matmuls as collective
    matmuls (where `applies`)."""
    token = _ACTIVE.set(on)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    return _ACTIVE.get()


def unsupported(cfg) -> str | None:
    """Why a run of config cfg must not trace its model inside use_collective_matmul(), or
    None. (Layouts the ring does not handle fall back by themselves: see `applies`.) The
    reasons live in config/rules.py, which refuses execution.tp_overlap with them (it imports no jax)."""
    return tp_overlap_unsupported(cfg, cfg.mesh.degrees())


def applies(seq_len: int) -> bool:
    """A sequence-parallel layout the ring handles: tensor > 1 and not yet manual, and the
    sequence cut into context x tp chunks (else XLA keeps it whole, rules._to_spec)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return False
    shape = dict(mesh.shape)
    tp, cp = shape.get(AXIS, 1), shape.get(CONTEXT, 1)
    return (tp > 1 and not {AXIS, CONTEXT} & set(mesh.manual_axes)
            and seq_len % (cp * tp) == 0)


class _Cfg(NamedTuple):
    role: str
    w_last: bool  # weights stored [O, I] (contracted axis last)
    precision: jax.lax.Precision | None
    tp: int
    context: bool  # the mesh splits the sequence over 'context' too (manual beside 'tensor')

    @property
    def axes(self) -> set[str]:
        return {AXIS, CONTEXT} if self.context else {AXIS}

    @property
    def split(self):
        """The sequence spec of a sequence-parallel array: over ('context', 'tensor')."""
        return (CONTEXT, AXIS) if self.context else AXIS

    @property
    def whole(self):
        """The sequence spec of a gathered array: whole per context shard."""
        return CONTEXT if self.context else None


def collective_matmul(x_BSI, w2s, role: str, *, w_last: bool, precision=None) -> list:
    """[x [B, S, I] times w2 for w2 in w2s] as one collective matmul over 'tensor'; each w2 is
    2-D, [I, O] or (w_last) [O, I], multiplied in x's dtype. role: 'column' (O sharded over
    'tensor', x sequence-sharded on entry; any number of weights share the ring) or 'row' (I
    sharded, one weight, y sequence-sharded on exit). Weight gradients are summed in float32
    and returned in each w2's dtype."""
    if role == "row" and len(w2s) != 1:
        raise ValueError(f"a row-parallel collective matmul takes one weight, got {len(w2s)}")
    shape = dict(jax.sharding.get_abstract_mesh().shape)
    cfg = _Cfg(role, w_last, precision, shape[AXIS], shape.get(CONTEXT, 1) > 1)
    return list(_ring(x_BSI, tuple(w2s), cfg))


# --- the products of one chunk -------------------------------------------------------------

def _xw(x_BsI, w, cfg: _Cfg):
    """x [B, s, I] @ w -> [B, s, O], one flattened 2-D GEMM in x's dtype."""
    dims = ((1,), (1,)) if cfg.w_last else ((1,), (0,))
    y = jax.lax.dot_general(x_BsI.reshape(-1, x_BsI.shape[-1]), w.astype(x_BsI.dtype),
                            (dims, ((), ())), precision=cfg.precision)
    return y.reshape(*x_BsI.shape[:-1], -1)


def _dyw(dy_BsO, w, cfg: _Cfg):
    """dy [B, s, O] @ w^T -> [B, s, I]."""
    dims = ((1,), (0,)) if cfg.w_last else ((1,), (1,))
    dx = jax.lax.dot_general(dy_BsO.reshape(-1, dy_BsO.shape[-1]), w.astype(dy_BsO.dtype),
                             (dims, ((), ())), precision=cfg.precision)
    return dx.reshape(*dy_BsO.shape[:-1], -1)


def _xdy(x_BsI, dy_BsO, cfg: _Cfg):
    """The weight gradient x^T dy in float32, in w's layout ([I, O] or [O, I])."""
    a, b = x_BsI.reshape(-1, x_BsI.shape[-1]), dy_BsO.reshape(-1, dy_BsO.shape[-1])
    if cfg.w_last:
        a, b = b, a
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=cfg.precision,
                               preferred_element_type=jnp.float32)


def _pass(x, tp: int):
    """x one step round the ring: device r sends to r - 1, so after t steps device r holds
    what device r + t started with."""
    return jax.lax.ppermute(x, AXIS, [(j, (j - 1) % tp) for j in range(tp)])


def _step(sent, computed):
    """One ring step as a unit: what was sent and what was computed meanwhile leave together,
    so step t + 1's GEMM depends on step t's and cannot be merged with it."""
    return jax.lax.optimization_barrier((sent, computed))


def _put(buf, chunk, i, s):
    return jax.lax.dynamic_update_slice_in_dim(buf, chunk, i * s, axis=1)


def _cut(x, i, s):
    return jax.lax.dynamic_slice_in_dim(x, i * s, s, axis=1)


# --- the rings ----------------------------------------------------------------------------

def _gather_multiply(chunk, r, cfg: _Cfg, products, carry=None):
    """The column ring: chunk (r + t) mod tp is held at step t, and products(chunk, c,
    carry) -> (arrays [B, s, ...], carry) are computed while it travels on. Returns (the
    gathered chunks [B, S, I], each product gathered [B, S, ...], the final carry)."""
    s = chunk.shape[1]
    gathered = outs = None
    for t in range(cfg.tp):
        c = (r + t) % cfg.tp
        ys, carry = products(chunk, c, carry)
        here = chunk
        if t < cfg.tp - 1:
            chunk, (ys, carry, here) = _step(_pass(chunk, cfg.tp), (ys, carry, here))
        if outs is None:
            new = lambda a: jnp.zeros((a.shape[0], s * cfg.tp, *a.shape[2:]), a.dtype)  # noqa: E731
            gathered, outs = new(here), [new(y) for y in ys]
        gathered = _put(gathered, here, c, s)
        outs = [_put(o, y, c, s) for o, y in zip(outs, ys)]
    return gathered, outs, carry


def _multiply_scatter(partial, r, cfg: _Cfg, carry):
    """The row ring: partial(c, carry) -> (chunk c's partial sum [B, s, ...], carry) at step
    t for c = (r + t + 1) mod tp, added to the running sum from r + 1 while that travels on.
    Returns device r's whole sum (chunk r). carry passes the barriers with each step."""
    acc = None
    for t in range(cfg.tp):
        part, carry = partial((r + t + 1) % cfg.tp, carry)
        sent = None if acc is None else _pass(acc, cfg.tp)
        sent, (part, carry) = _step(sent, (part, carry))
        acc = part if sent is None else sent + part
    return acc


def _w_spec(cfg: _Cfg):
    sharded_n = cfg.role == "column"  # the out features (O) are the sharded ones
    return P(AXIS, None) if sharded_n == cfg.w_last else P(None, AXIS)


def _dw_spec(cfg: _Cfg):
    """A weight gradient stacked over 'context' (one per context shard, its own tokens')."""
    return P(CONTEXT, *_w_spec(cfg)) if cfg.context else _w_spec(cfg)


def _stack(dw, cfg: _Cfg):
    return dw[None] if cfg.context else dw


def _sum_over_context(dws, cfg: _Cfg):
    """The context shards' weight gradients summed (outside the shard_map: XLA reduces them
    onto the weights' own sharding)."""
    return tuple(dw.sum(0, dtype=dw.dtype) for dw in dws) if cfg.context else dws


def _shard_map(body, cfg: _Cfg, in_specs, out_specs):
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=cfg.axes,
                         check_vma=False)


def _column_fwd(x, ws, cfg: _Cfg):
    """ys [B, S, O_j / tp] and the gathered x, one [1, B, S, I] per device (the residual;
    S: the context shard's tokens)."""
    def body(x_BsI, *ws):
        gathered, ys, _ = _gather_multiply(
            x_BsI, jax.lax.axis_index(AXIS), cfg,
            lambda chunk, c, carry: ([_xw(chunk, w, cfg) for w in ws], carry))
        return tuple(ys), gathered[None]
    n = len(ws)
    return _shard_map(body, cfg, (P(None, cfg.split, None),) + (_w_spec(cfg),) * n,
                      ((P(None, cfg.whole, AXIS),) * n, P(AXIS, None, cfg.whole)))(x, *ws)


def _column_bwd(gathered, ws, dys, cfg: _Cfg):
    """dx [B, S/tp, I] (reduce-scattered round the ring) and each weight's gradient."""
    def body(g_1BSI, *rest):
        ws, dys = rest[:len(rest) // 2], rest[len(rest) // 2:]
        x_BSI, s = g_1BSI[0], g_1BSI.shape[2] // cfg.tp
        dws = tuple(_stack(_xdy(x_BSI, dy, cfg).astype(w.dtype), cfg)
                    for w, dy in zip(ws, dys))

        def partial(c, dys):  # chunk c's dx: the sum over the weights
            return sum(_dyw(_cut(dy, c, s), w, cfg) for w, dy in zip(ws, dys)), dys
        return _multiply_scatter(partial, jax.lax.axis_index(AXIS), cfg, dys), dws
    n = len(ws)
    dx, dws = _shard_map(body, cfg, (P(AXIS, None, cfg.whole),) + (_w_spec(cfg),) * n
                         + (P(None, cfg.whole, AXIS),) * n,
                         (P(None, cfg.split, None), (_dw_spec(cfg),) * n))(gathered, *ws, *dys)
    return dx, _sum_over_context(dws, cfg)


def _row_fwd(x, w, cfg: _Cfg):
    def body(x_BSi, w):
        s = x_BSi.shape[1] // cfg.tp
        return _multiply_scatter(lambda c, x: (_xw(_cut(x, c, s), w, cfg), x),
                                 jax.lax.axis_index(AXIS), cfg, x_BSi)
    return _shard_map(body, cfg, (P(None, cfg.whole, AXIS), _w_spec(cfg)),
                      P(None, cfg.split, None))(x, w)


def _row_bwd(x, w, dy, cfg: _Cfg):
    """dx [B, S, I/tp] (dy gathered round the ring) and dW, both a GEMM per step."""
    def body(x_BSi, w, dy_BsO):
        s = dy_BsO.shape[1]

        def products(chunk, c, dw):  # chunk c's dx; its share of dW added to the carry
            return [_dyw(chunk, w, cfg)], dw + _xdy(_cut(x_BSi, c, s), chunk, cfg)
        _, (dx,), dw = _gather_multiply(dy_BsO, jax.lax.axis_index(AXIS), cfg, products,
                                        jnp.zeros(w.shape, jnp.float32))
        return dx, _stack(dw.astype(w.dtype), cfg)
    dx, dw = _shard_map(body, cfg, (P(None, cfg.whole, AXIS), _w_spec(cfg),
                                    P(None, cfg.split, None)),
                        (P(None, cfg.whole, AXIS), _dw_spec(cfg)))(x, w, dy)
    return dx, _sum_over_context((dw,), cfg)[0]


# --- differentiation: forward and backward rings as separate shard_maps ----------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring(x, ws, cfg: _Cfg):
    return _ring_fwd(x, ws, cfg)[0]


def _ring_fwd(x, ws, cfg: _Cfg):
    if cfg.role == "column":
        ys, gathered = _column_fwd(x, ws, cfg)
        ys = tuple(_like(y, x, *ws) for y in ys)
        return ys, (_like(gathered, x), ws)
    return (_like(_row_fwd(x, ws[0], cfg), x, *ws),), (x, ws)


def _ring_bwd(cfg: _Cfg, res, dys):
    if cfg.role == "column":
        gathered, ws = res
        dx, dws = _column_bwd(gathered, ws, dys, cfg)
        return _like(dx, gathered), tuple(_like(g, w) for g, w in zip(dws, ws))
    x, ws = res
    dx, dw = _row_bwd(x, ws[0], dys[0], cfg)
    return _like(dx, x), (_like(dw, ws[0]),)


def _like(out, *likes):
    """out typed to vary over the manual axes its inputs vary over. The shard_maps run
    without jax's varying-axes check (with it, JAX gives the residuals of a shard_map nested
    in a pipeline stage's, under the stage's remat, specs on the outer 'pipeline' axis), so
    their results come back typed invariant over the axes already manual outside, though they
    differ per stage; a later transpose would otherwise sum them over the stages."""
    for like in likes:
        out = match_varying(out, like)
    return out


_ring.defvjp(_ring_fwd, _ring_bwd)
