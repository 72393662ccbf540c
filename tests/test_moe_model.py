"""Mixture-of-experts models (issue 37: Mixtral, Qwen3-MoE; models/common/moe_block.py): the
presets have the published parameter counts; the dropless grouped-GEMM layer inside the model
equals every expert run densely; fsdp x tensor and data x context layouts equal one device;
training with the load-balancing loss evens out a router skewed onto one expert, and the
loop logs the auxiliary loss and routing statistics; what MoE cannot run with yet is refused
in one line."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.layouts import assert_matches, loss_and_grads, make_batch, tiny_config
from tests.helpers.restore import restore_through
from tests.helpers.small import run_small, small_config
from titanax.config import ConfigError, apply_overrides
from titanax.models import model_spec, preset
from titanax.models.common import moe_block
from titanax.models.common.moe import experts_dense
from titanax.models.common.moe_hooks import inactive_expert_params
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import model_context
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.state import create_train_state, jit_train_step

pytestmark = pytest.mark.usefixtures("devices8")

# _skewed_run: the embedding shift (one init_std), router column 0 added, steps
EMBED_SHIFT, SKEW, STEPS = 0.02, 0.05, 16
MOE = {"model.arch": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2,
       "model.n_layers": 2, "execution.matmul_precision": "highest", "mesh.data": 1}


@pytest.mark.parametrize("name, total, active", [
    ("mixtral_8x7b", 46_702_792_704, 12_879_925_248),  # Mistral AI: 46.7 B, 12.9 B active
    ("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704),  # Qwen: 30.5 B, 3.3 B active
    ("qwen3_235b_a22b", 235_093_634_560, 22_190_763_520),  # Qwen: 235 B, 22 B active
])
def test_presets_have_the_published_parameter_counts(name, total, active):
    m = preset(name)
    n = model_spec(m).count_params(m)
    assert (n, n - inactive_expert_params(m)) == (total, active)


@pytest.fixture(scope="module")
def one_device():
    return loss_and_grads(tiny_config(**MOE), jax.devices()[:1])[:2]


def test_grouped_gemm_layer_equals_every_expert_dense(one_device, monkeypatch):
    monkeypatch.setattr(moe_block, "experts_ragged", experts_dense)
    assert_matches(one_device, loss_and_grads(tiny_config(**MOE), jax.devices()[:1])[:2])


@pytest.mark.parametrize("over", [{"mesh.fsdp": 2, "mesh.tensor": 2},
                                  {"mesh.data": 2, "mesh.context": 2, "model.arch": "qwen3_moe"}],
                         ids=["fsdp2_tp2", "dp2_cp2_qwen3_moe"])
def test_layouts_equal_one_device(over, one_device):
    cfg = tiny_config(**{**MOE, **over})
    want = one_device if cfg.model.arch == "mixtral" else \
        loss_and_grads(tiny_config(**{**MOE, "model.arch": "qwen3_moe"}), jax.devices()[:1])[:2]
    loss, grads, jaxpr = loss_and_grads(cfg, jax.devices()[:4])
    assert_dispatch_is_per_device(cfg, jaxpr)
    assert_matches((loss, grads), want)


def assert_dispatch_is_per_device(cfg, jaxpr: str) -> None:
    """The (token, expert) pairs are sorted per device (models/common/moe_ep.py), one device's
    B x S x K / token shards of them (expert parallelism sorts the rows it receives too): a
    global dispatch would sort all B x S x K."""
    m = cfg.mesh
    microbatches = cfg.pipeline.microbatches if m.pipeline > 1 else 1
    local = (cfg.train.batch_size * cfg.train.seq_len * cfg.model.experts_per_token
             // (m.data * m.fsdp * m.expert * m.context * microbatches))
    sorts = re.findall(r"[^\n]* = sort\[", jaxpr)
    sizes = {int(n) for n in re.findall(r"i32\[(\d+)\][^=\n]* = sort\[", jaxpr)}
    assert min(sizes) == local, f"pairs sorted: {sizes}, one device's: {local}"
    if m.pipeline == 1:  # (a pipeline stage runs its shard_maps without varying types)
        # Inside the experts' shard_map (its values carry their varying axes): per device.
        assert all("{V:" in line for line in sorts), sorts


PP2 = {"mesh.pipeline": 2, "pipeline.microbatches": 2}


@pytest.mark.parametrize("over, n", [({"mesh.expert": 2}, 2), ({"mesh.expert": 4}, 4),
                                     ({"mesh.expert": 2, "mesh.fsdp": 2, "mesh.tensor": 2}, 8),
                                     ({"mesh.expert": 2, **PP2}, 4),
                                     ({"mesh.expert": 2, "mesh.context": 2}, 4)],
                         ids=["ep2", "ep4", "ep2_fsdp2_tp2", "ep2_pp2", "ep2_cp2"])
def test_expert_parallel_layouts_equal_one_device(over, n, one_device):
    """Experts split over mesh.expert, tokens sent by all-to-all (models/common/moe_ep.py),
    dropless: the loss and every gradient of one device."""
    loss, grads, jaxpr = loss_and_grads(tiny_config(**{**MOE, **over}), jax.devices()[:n])
    assert jaxpr.count("all_to_all") >= 3, "the experts did not run expert-parallel"
    assert_dispatch_is_per_device(tiny_config(**{**MOE, **over}), jaxpr)
    assert_matches((loss, grads), one_device)


@pytest.mark.parametrize("over, n", [({"mesh.data": 2}, 4),
                                     ({"pipeline.schedule": "circular", "mesh.expert": 2}, 4)],
                         ids=["gpipe_dp2", "circular_ep2"])
def test_pipelines_carry_the_routing_sums(over, n):
    """The routing sums travel through the pipeline's ticks (parallel/pipeline.py), pooled
    over every microbatch as one device pools them: 4 layers on 2 stages (circular: x 2
    chunks each). With DeepSeek-V3's routing bias on: its "gradient", each layer's tokens per
    expert, is pooled the same way (idle ticks adding nothing)."""
    four = {**MOE, "model.n_layers": 4, "model.router_bias_update_rate": 1e-3}
    want = loss_and_grads(tiny_config(**four), jax.devices()[:1])[:2]
    assert_matches(loss_and_grads(tiny_config(**{**four, **PP2, **over}), jax.devices()[:n])[:2],
                   want)


@pytest.mark.parametrize("fsdp, expert_dim, embed_dim", [(2, ("fsdp",), None),
                                                       (8, None, ("fsdp",))])
def test_fsdp_splits_the_experts_when_they_divide(fsdp, expert_dim, embed_dim):
    """parallel/rules.expert_weight_axes: 4 experts over fsdp 2 are split along E (their
    leading axis, gathered without a transposed copy); over fsdp 8 they do not divide, and D
    is split as for every other weight."""
    cfg = tiny_config(**{**MOE, "mesh.fsdp": fsdp})
    mesh = build_mesh(cfg.mesh, jax.devices()[:fsdp])
    state = create_train_state(cfg, mesh, make_optimizer(cfg))[1]
    axes = lambda entry: None if entry is None else tuple(  # noqa: E731
        a for a in ((entry,) if isinstance(entry, str) else entry) if mesh.shape[a] > 1) or None
    for name, d in (("w_gate", 2), ("w_down", 3)):
        spec = state.weights["layers"][name].sharding.spec
        assert (axes(spec[1]), axes(spec[d])) == (expert_dim, embed_dim), (name, spec)


def test_experts_on_rows_the_mesh_cannot_split():
    """One row (a decode step) on fsdp 2 x tensor 2: the tokens are whole on every device, the
    experts' weights split over fsdp (D) and tensor (F, each tensor rank its slice of every
    expert's width, summed over tensor). Values and gradients equal experts_ragged's: no
    gradient summed over the replicated tokens' copies."""
    from titanax.config import MeshConfig
    from titanax.models.common.moe import experts_ragged, route
    from titanax.models.common.moe_ep import experts_sharded
    T, E, D, F = 6, 4, 8, 16
    ks = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(ks[0], (T, D))
    r = route(jax.random.normal(ks[1], (T, E)), 2, norm_topk=True)
    w = [jax.random.normal(k, s) * 0.3 for k, s in zip(jax.random.split(ks[2], 3),
                                                       ((E, D, F), (E, D, F), (E, F, D)))]
    kw = dict(dtype=jnp.float32, precision="highest")

    def loss(f, x, *w):
        return jnp.sum(jnp.sin(f(x, *w)))

    sharded = lambda x, *w: experts_sharded(x[None], r, *w, **kw)[0][0]  # noqa: E731
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[:4])
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(lambda *a: loss(sharded, *a), argnums=(0, 1, 2, 3)))(
            x, *w)
    want = jax.value_and_grad(lambda *a: loss(lambda x, *w: experts_ragged(x, r, *w, **kw), *a),
                              argnums=(0, 1, 2, 3))(x, *w)
    for g, r_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r_), rtol=1e-5, atol=1e-6)


def test_expert_capacity_drops_the_pairs_past_it_and_counts_them():
    """execution.expert_capacity_factor: a rank sends at most ceil(factor x pairs / ep) rows to
    each expert rank; later pairs (in expert order) add nothing and are counted. Against
    experts_ragged with exactly those pairs' gates zeroed, computed here independently."""
    from titanax.config import MeshConfig
    from titanax.models.common.moe import Routing, experts_ragged
    from titanax.models.common.moe_ep import capacity, experts_sharded
    ep, T, K, E, D, F = 2, 12, 2, 4, 8, 16
    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (T, D))
    # Skewed routing: most pairs go to experts 0 and 1 (rank 0), so rank 0 overflows.
    expert = jnp.where(jax.random.uniform(ks[1], (T, K)) < 0.8, jnp.array([0, 1]),
                       jnp.array([2, 3])).astype(jnp.int32)
    gate = jax.nn.softmax(jax.random.normal(ks[2], (T, K)), -1)
    r = Routing(expert, gate, jnp.full((T, E), 1.0 / E))
    w = [jax.random.normal(k, s) * 0.3 for k, s in zip(jax.random.split(ks[3], 3),
                                                       ((E, D, F), (E, D, F), (E, F, D)))]
    mesh = build_mesh(MeshConfig(data=1, expert=ep), jax.devices()[:ep])
    kw = dict(dtype=jnp.float32, precision="highest")
    for factor in (None, 2.0, 0.5):
        with jax.set_mesh(mesh):
            y, dropped = jax.jit(lambda x, g, *w: experts_sharded(
                x[:, None], Routing(expert, g, r.probs_RE), *w, capacity_factor=factor,
                **kw))(x, gate, *w)
        y = y[:, 0]
        # Each source rank's tokens are T / ep consecutive rows; its pairs in expert order
        # fill each destination's C slots first come first served.
        C = capacity(T // ep * K, ep, factor)
        keep = np.ones((T, K), bool)
        for src in range(ep):
            rows = np.arange(src * T // ep, (src + 1) * T // ep)
            pairs = sorted((int(expert[t, k]), t, k) for t in rows for k in range(K))
            used = {}
            for e, t, k in pairs:
                used[e // (E // ep)] = used.get(e // (E // ep), 0) + 1
                keep[t, k] = used[e // (E // ep)] <= C
        want = experts_ragged(x, Routing(expert, gate * keep, r.probs_RE), *w, **kw)
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert float(dropped) == (~keep).sum()
        assert (float(dropped) > 0) == (factor == 0.5)


def _skewed_run(coef: float, bias_rate: float = 0.0):
    """STEPS steps of a router skewed onto expert 0 (a shared component in every token's
    embedding, which router column 0 picks up: expert 0 is in every token's top 2, max load /
    mean load = 4 experts / 2 = 2), its experts all equal (so the token loss barely cares
    where a token goes): (the load spread at each step, the last step's metrics, the last
    state's params)."""
    cfg = tiny_config(**{**MOE, "model.router_aux_loss_coef": coef, "optim.lr": 3e-2,
                         "optim.warmup_steps": 1, "model.router_bias_update_rate": bias_rate})
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    tx = make_optimizer(cfg)
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
    params = state.weights
    params["embed"].set_value(params["embed"].get_value() + EMBED_SHIFT)
    router = params["layers"]["router"]
    router.set_value(router.get_value().at[:, :, 0].add(SKEW))
    for name in ("w_gate", "w_up", "w_down"):
        w = params["layers"][name]
        w.set_value(jnp.broadcast_to(w.get_value()[:, :1], w.get_value().shape))
    step = jit_train_step(cfg, mesh, graphdef, shardings, tx, lr_schedule(cfg))
    batch, spread = make_batch(cfg), []
    with model_context(mesh):
        for _ in range(STEPS):
            state, m = step(state, batch)
            spread.append(float(m["aux/max_over_mean_load"]))
    return spread, m, jax.device_get(state.weights)


@pytest.fixture(scope="module")
def unbalanced():
    """The skewed run with neither balancing: the router drifts only as the embedding does
    (measured: 2.0, 2.0, 1.98, 1.92, 1.52, 1.53, 1.40, 1.41, then 1.31-1.42)."""
    return _skewed_run(0.0)[0]


def test_balancing_loss_evens_out_a_skewed_router(unbalanced):
    """With the load-balancing loss weighted up the spread falls fast (measured: 2.0, 1.62,
    1.93, 1.31, 1.53, 1.20, 1.10, 1.18). The step reports both terms."""
    balanced, m, _ = _skewed_run(1.0)
    free = unbalanced
    assert balanced[0] == free[0] == pytest.approx(2.0)
    assert np.mean(balanced[1:6]) < np.mean(free[1:6]) - 0.1, (balanced, free)
    assert balanced[-1] < 1.3, balanced
    assert float(m["aux/load_balance"]) == pytest.approx(float(m["aux/load_balance_loss"]))


def test_routing_bias_evens_out_a_skewed_router_without_the_loss(unbalanced):
    """DeepSeek-V3's auxiliary-loss-free balancing (model.router_bias_update_rate; no
    load-balancing loss): each step moves every layer's bias against its load, so the spread
    falls where the unbalanced run stalls (measured, steps 8-15: 1.25, 1.25, 1.20, 1.19,
    1.10, 1.08, 1.10, 1.10 against 1.41, 1.33, 1.35, 1.42, 1.36, 1.41, 1.39, 1.36). The biases
    keep a zero mean, and only the update rule moves them: no optimizer step is mixed in."""
    rate = 0.005
    biased, m, params = _skewed_run(0.0, bias_rate=rate)
    assert biased[0] == pytest.approx(2.0)
    assert np.mean(biased[8:]) < np.mean(unbalanced[8:]) - 0.1, (biased, unbalanced)
    assert max(biased[10:]) < 1.25, biased
    bias_LE = np.asarray(params["layers"]["router_bias"].get_value())
    np.testing.assert_allclose(bias_LE.sum(-1), 0.0, atol=1e-6)
    # rate x (sign - its mean over the 4 experts) is a multiple of rate / 4 every step
    np.testing.assert_allclose(bias_LE, np.round(bias_LE / (rate / 4)) * rate / 4, atol=1e-6)
    assert np.abs(bias_LE).max() > 0
    # the loads (hundreds of tokens per expert) are not in the gradient norm, nor logged
    assert float(m["grad_norm"]) < 20, float(m["grad_norm"])  # measured 1.04
    assert "aux/statistic_probe" not in m


def test_the_loop_logs_the_auxiliary_loss_and_routing(tmp_path):
    small = {"model.arch": "qwen3_moe", "model.n_experts": 4, "model.experts_per_token": 2,
             "model.ffn_dim": 64, "model.head_dim": 32}
    result, log = run_small(tmp_path, 2, **small)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert trained and all(k in trained[-1] for k in (
        "aux/load_balance", "aux/load_balance_loss", "aux/max_over_mean_load",
        "aux/dropped_fraction")), trained
    assert trained[-1]["aux/dropped_fraction"] == 0.0  # one device: dropless
    # 2 (= experts_per_token) when balanced, more when not; the logged term is it x 0.001
    lb = trained[-1]["aux/load_balance_loss"]
    assert 2.0 <= lb < 4.0 and trained[-1]["aux/load_balance"] == pytest.approx(1e-3 * lb)
    assert np.isfinite(result.losses[max(result.losses)]), log


def test_expert_parallelism_needs_an_moe_model():
    with pytest.raises(ConfigError, match="^mesh.expert: 2: expert parallelism splits"):
        tiny_config(**{"mesh.expert": 2, "mesh.data": 1})


@pytest.mark.parametrize("over, field", [
    ({**PP2, "pipeline.schedule": "1f1b"}, "pipeline.schedule"),
    ({"execution.matmul_precision": "fp8_tensorwise"}, "execution.matmul_precision"),
    ({"lora.rank": 4}, "lora.rank"),
    ({"mesh.expert": 3}, "mesh.expert"),  # 4 experts do not split 3 ways
])
def test_what_moe_cannot_run_with_is_refused_in_one_line(over, field):
    with pytest.raises(ConfigError) as e:
        apply_overrides(tiny_config(**MOE), over)
    assert str(e.value).startswith(f"{field}:") and "\n" not in str(e.value)


def test_checkpoint_restores_across_the_expert_split(tmp_path):
    """Experts saved split along D (4 experts over fsdp 8 do not divide) restore into a
    layout that splits them along E (fsdp 2 x data 4) and back: the same values, each leaf in
    the new layout's sharding, so checkpoints written before parallel/rules.expert_weight_axes
    split E restore as after any change of mesh."""
    moe = {"model.arch": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2}
    cfgs = [small_config(**moe, **{"mesh.data": 1, "mesh.fsdp": 8}),
            small_config(**moe, **{"mesh.data": 4, "mesh.fsdp": 2}),
            small_config(**moe, **{"mesh.data": 1, "mesh.fsdp": 8})]
    for cfg, state in restore_through(tmp_path, cfgs):
        w_up = state.weights["layers"]["w_up"].sharding.spec
        assert ("fsdp" in str(w_up[1])) == (cfg.mesh.fsdp == 2), w_up  # E split, else D
