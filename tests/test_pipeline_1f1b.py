"""The fused 1F1B schedule: its tick table, loss and gradients equal to one device's
jax.value_and_grad on a toy model, and compiled activation memory that stays flat in the
microbatches while gpipe's grows by a stage's layer inputs per microbatch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from titanax.config import MeshConfig
from titanax.parallel.mesh import build_mesh
from titanax.parallel.pipeline import PipelineSchedule, run_pipelined
from titanax.parallel.pipeline_1f1b import in_flight, run_1f1b, schedule_table_1f1b, ticks_1f1b

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices


def layer_fn(x_bSD, w, pos_bS):  # uses its extras, so a wrong microbatch split shows
    h_bSD = jnp.tanh(x_bSD @ w["w"] + w["b"])
    return x_bSD + h_bSD * (1.0 + 0.1 * pos_bS[..., None])


def head_fn(head, y_bSD, targets_bS):
    """Summed cross-entropy of y @ w_out. The target logit by an iota compare, as
    ops/cross_entropy.py: take_along_axis on a vocab-sharded axis inside the shard_map aborts
    XLA's SPMD partitioner (jax 0.11.2, a gather partitioning check failure)."""
    logits = (y_bSD * head["scale"]) @ head["w_out"]
    is_target = jnp.arange(logits.shape[-1]) == targets_bS[..., None]
    return jnp.sum(jax.nn.logsumexp(logits, -1) - jnp.sum(jnp.where(is_target, logits, 0), -1))


def sequential(layers, head, x_BSD, pos_BS, targets_BS):
    y_BSD = jax.lax.scan(lambda x, w: (layer_fn(x, w, pos_BS), None), x_BSD, layers)[0]
    return head_fn(head, y_BSD, targets_BS)


def toy(L, B, S=4, D=16, V=24, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    layers = {"w": jax.random.normal(k[0], (L, D, D)) / np.sqrt(D),
              "b": 0.1 * jax.random.normal(k[1], (L, D))}
    head = {"w_out": jax.random.normal(k[2], (D, V)) / np.sqrt(D),
            "scale": 1.0 + 0.1 * jax.random.normal(k[3], (D,))}
    x_BSD = jax.random.normal(k[4], (B, S, D))
    pos_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    targets_BS = jax.random.randint(k[5], (B, S), 0, V)
    return layers, head, x_BSD, pos_BS, targets_BS


# LLVM at -O0 halves XLA:CPU compile times, what these tests mostly spend; the HLO passes
# (and so the numerics and the buffer assignment) are the same.
FAST = {"xla_backend_optimization_level": 0}


def compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST)


@functools.cache  # cases with the same batch share it
def reference(L, B):
    """jax.value_and_grad of the plain sequential stack on one device."""
    args = toy(L, B)
    return compiled(jax.value_and_grad(sequential, argnums=(0, 1, 2)), *args)(*args)


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


@pytest.mark.parametrize("stages,micro", [(2, 4), (2, 9), (4, 5), (4, 16), (1, 3), (3, 7)])
def test_table_runs_each_microbatch_forward_then_backward_with_k_in_flight(stages, micro):
    table = schedule_table_1f1b(stages, micro)
    K = in_flight(stages, micro)
    prev_fwd = prev_bwd = None  # stage s-1's ticks
    assert table.shape == (ticks_1f1b(stages, micro), stages, 2)
    for s in range(stages):
        fwd, bwd = table[:, s, 0], table[:, s, 1]
        assert fwd[fwd >= 0].tolist() == list(range(micro))  # each once, in order
        assert bwd[bwd >= 0].tolist() == list(range(micro))
        t_fwd = np.array([np.argmax(fwd == m) for m in range(micro)])
        t_bwd = np.array([np.argmax(bwd == m) for m in range(micro)])
        assert np.all(t_bwd >= t_fwd)  # same tick only on the last stage (head, then backward)
        assert np.all((t_bwd == t_fwd) == (s == stages - 1))
        if s:  # activations arrive from s-1 one tick later, gradients leave to s-1 one later
            assert np.all(t_fwd == prev_fwd + 1) and np.all(t_bwd + 1 == prev_bwd)
        prev_fwd, prev_bwd = t_fwd, t_bwd
        # held at tick t: started (forward at or before t) and not finished (backward at or after)
        held = [(t_fwd <= t) & (t_bwd >= t) for t in range(len(table))]
        assert max(h.sum() for h in held) == min(micro, 2 * (stages - s) - 1) <= K
    # Lockstep time with idle slots skipped, forward F = 1 and backward B = 2 per tick: the
    # slowest stage of each tick sets its length; the same bubble as gpipe, (M + PP - 1)(F + B).
    cost = ((table[..., 0] >= 0) * 1 + (table[..., 1] >= 0) * 2).max(axis=1).sum()
    assert cost == (micro + stages - 1) * 3


MESHES = {"pp2": dict(data=4, pipeline=2), "pp4": dict(data=2, pipeline=4),
          "dp2_pp2_tp2": dict(data=2, pipeline=2, tensor=2),
          "fsdp2_pp2_tp2": dict(data=1, fsdp=2, pipeline=2, tensor=2)}


@pytest.mark.parametrize("mesh_name,micro", [
    ("pp2", 1), ("pp2", 2), ("pp2", 5), ("pp4", 1), ("pp4", 4), ("pp4", 9),
    ("dp2_pp2_tp2", 3), ("fsdp2_pp2_tp2", 5)])
def test_loss_and_gradients_equal_one_device(mesh_name, micro):
    L, B = 8, 4 * micro
    layers, head, x_BSD, pos_BS, targets_BS = toy(L, B)
    want_loss, want_grads = reference(L, B)

    mesh = build_mesh(MeshConfig(**MESHES[mesh_name]))
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    batch = ("data", "fsdp")
    args = ({"w": put(layers["w"], "pipeline", "fsdp", "tensor"),
             "b": put(layers["b"], "pipeline", "tensor")},
            {"w_out": put(head["w_out"], None, "tensor"), "scale": put(head["scale"])},
            put(x_BSD, batch), put(pos_BS, batch), put(targets_BS, batch))
    f = lambda layers, head, x, pos, tgt: run_1f1b(layer_fn, head_fn, layers, head, x, pos,
                                                   tgt, micro)
    with jax.set_mesh(mesh):
        # 3 * loss: the backward rule scales the stored gradients by the incoming cotangent.
        grad_fn = jax.value_and_grad(lambda *a: 3.0 * f(*a), argnums=(0, 1, 2))
        # f alone is not differentiated: forward ticks only.
        (loss3, grads), loss = compiled(lambda *a: (grad_fn(*a), f(*a)), *args)(*args)
    assert loss3.dtype == loss.dtype == jnp.float32
    assert_close(loss3 / 3, want_loss)
    assert_close(loss, want_loss)
    assert_close(jax.tree.map(lambda g: g / 3, grads), want_grads)
    assert grads[0]["w"].sharding.spec[0] == "pipeline"  # layer grads stay with their stage


def _temp_bytes(fn, L, b, M, S, D, V):
    B = M * b
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((L, D, D), jnp.float32), ((L, D), jnp.float32), ((D, V), jnp.float32), ((D,), jnp.float32),
        ((B, S, D), jnp.float32), ((B, S), jnp.int32), ((B, S), jnp.int32)]]
    g = jax.grad(lambda w, bias, w_out, scale, x, pos, tgt: fn(
        {"w": w, "b": bias}, {"w_out": w_out, "scale": scale}, x, pos, tgt, M),
        argnums=(0, 1, 2, 3, 4))
    return compiled(g, *shapes).memory_analysis().temp_size_in_bytes


def test_activation_memory_flat_in_microbatches_unlike_gpipe():
    """Same microbatch b, M = 4, 8, 16 on PP=2 (8 layers a stage). gpipe's backward keeps
    every layer input of every tick: + (L/PP) b*S*D per microbatch. 1F1B holds K = 3 in flight
    whatever M: what grows is the per-microbatch input/output (x, dx), a few b*S*D."""
    stages, L, b, S, D, V = 2, 16, 2, 16, 64, 32
    bSD = b * S * D * 4
    mesh = build_mesh(MeshConfig(data=1, pipeline=stages), devices=jax.devices()[:stages])
    gpipe = lambda layers, head, x, pos, tgt, M: head_fn(
        head, run_pipelined(layer_fn, layers, x, pos, PipelineSchedule(M)), tgt)
    onef1b = lambda *args: run_1f1b(layer_fn, head_fn, *args)
    with jax.set_mesh(mesh):
        temp = {name: [_temp_bytes(fn, L, b, M, S, D, V) for M in (4, 8, 16)]
                for name, fn in [("gpipe", gpipe), ("1f1b", onef1b)]}
    print({name: [t / bSD for t in ts] for name, ts in temp.items()}, "b*S*D")
    per_micro = {name: (ts[2] - ts[0]) / 12 / bSD for name, ts in temp.items()}
    assert per_micro["gpipe"] >= 0.9 * (L // stages), temp  # measured ~10.4 b*S*D
    assert per_micro["1f1b"] <= 3, temp  # measured ~1.4 b*S*D
    assert temp["1f1b"][0] < temp["gpipe"][0]
