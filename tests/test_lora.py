"""LoRA (issue 35, docs/lora.md): adapters on the block's projections, only they trained.

Step 0 is the base model exactly (B = 0); eight steps match a reference that merges
W + scale * A B into a plain dense titanax model and runs optax's AdamW on A, B by hand; the
base weights come out bit-identical; the state holds moments for the adapters alone; a LoRA
run starts from a checkpoint saved without adapters, saves the adapters naming that base, and
resumes them; fsdp x tensor equals
one device; what LoRA cannot run with is refused in one line. lora.dropout: a step matches a
plain computation applying common/lora.py's masks; the masks repeat given the seed and step,
leave eval alone, and follow the tokens whatever the layout, pipeline or accumulation."""

from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers.layouts import make_batch, tiny_config
from tests.helpers.small import run_small, tree_equal
from titanax.checkpoint.lora_base import MissingBase
from titanax.config import ConfigError, apply_overrides
from titanax.generate import load_for_inference
from titanax.hf.exporter import export_hf
from titanax.models.common.attention import rope_attention
from titanax.models.common.layers import rms_norm
from titanax.models.common.lora import dropout_mask
from titanax.ops import IGNORE_INDEX
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import model_context
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.resolved import resolve
from titanax.train.state import Role, create_train_state, jit_eval_step, jit_train_step
from titanax.train.step import make_loss_fn

pytestmark = pytest.mark.usefixtures("devices8")  # the sharded layout's 4 of 8 devices

RANK, ALPHA = 4, 8.0
LORA = {"lora.rank": RANK, "lora.alpha": ALPHA, "model.n_layers": 2, "optim.warmup_steps": 1}


def _setup(cfg, devices):
    mesh = build_mesh(cfg.mesh, devices=devices)
    tx = make_optimizer(cfg)
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
    step = jit_train_step(cfg, mesh, graphdef, shardings, tx, lr_schedule(cfg))
    return mesh, graphdef, state, step, jit_eval_step(cfg, mesh, graphdef, shardings)


def _batches(cfg, n, prompt: int = 0):
    """n different batches (make_batch's layout, other tokens); prompt > 0: the first `prompt`
    targets of each row bear no loss (IGNORE_INDEX), as a fine-tuning example's prompt."""
    base = make_batch(cfg)
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        toks = rng.integers(0, cfg.model.vocab_size, base["inputs"].shape, dtype=np.int32)
        targets = np.roll(toks, -1, axis=1)
        targets[:, :prompt] = IGNORE_INDEX
        out.append({**base, "inputs": toks, "targets": targets})
    return out


def _train(cfg, devices, batches):
    mesh, _, state, step, _ = _setup(cfg, devices)
    losses = []
    with model_context(mesh):
        for batch in batches:
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    return losses, state


def test_step_zero_is_the_base_model_exactly():
    """Same seed, with and without adapters: the same base weights (the adapters draw no key
    from the params stream), and B = 0 gives the same logits and eval loss, bit for bit."""
    cfg0, cfg = tiny_config(**{"model.n_layers": 2}), tiny_config(**LORA)
    batch = make_batch(cfg)
    mesh, g0, s0, _, eval0 = _setup(cfg0, jax.devices()[:1])
    _, g1, s1, _, eval1 = _setup(cfg, jax.devices()[:1])
    assert tree_equal(s0.weights, s1.weights)
    with model_context(mesh):
        assert tree_equal(eval0(s0, batch), eval1(s1, batch))
        logits0, _ = nnx.merge(g0, s0.weights)(batch["inputs"])
        logits1, _ = nnx.merge(g1, s1.weights, s1.adapters)(batch["inputs"])
    np.testing.assert_array_equal(np.asarray(logits1), np.asarray(logits0))


# Each adapter merged into its weight: W [L, ...] += scale * (A B) in W's axis order.
_MERGE = {"wq": "ldr,lrhk->ldhk", "wk": "ldr,lrhk->ldhk", "wv": "ldr,lrhk->ldhk",
          "wo": "lhkr,lrd->ldhk", "w_gate": "ldr,lrf->ldf", "w_up": "ldr,lrf->ldf",
          "w_down": "lfr,lrd->ldf"}


def _merged(base: dict, ab: dict, scale: float) -> dict:
    layers = dict(base["layers"])
    for name, spec in _MERGE.items():
        layers[name] = layers[name] + scale * jnp.einsum(spec, ab[name]["a"], ab[name]["b"])
    return {**base, "layers": layers}


def test_eight_steps_match_a_merged_dense_reference():
    """The reference: the dense model (lora off) on W + scale A B, its gradient with respect to
    A and B through the merge (jax.grad), optax's clip + AdamW on them by hand. The batches
    carry a loss mask (a prompt's targets ignored), as fine-tuning data does."""
    cfg = tiny_config(**LORA)
    batches = _batches(cfg, 2, prompt=5) * 4  # seen again, so the loss falls
    losses, state = _train(cfg, jax.devices()[:1], batches)

    cfg0 = apply_overrides(cfg, {"lora.rank": 0})
    mesh, g0, s0, _, _ = _setup(cfg0, jax.devices()[:1])
    loss_fn = make_loss_fn(cfg0, g0, resolve(cfg0).spec)
    base = nnx.to_pure_dict(s0.weights)
    _, _, s1, _, _ = _setup(cfg, jax.devices()[:1])  # the adapters' initial values
    pure = nnx.to_pure_dict(s1.adapters)["layers"]
    ab = {n: {"a": pure[f"{n}_lora_a"], "b": pure[f"{n}_lora_b"]} for n in _MERGE}
    o = cfg.optim
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                                 weight_decay=o.weight_decay))
    opt = tx.init(ab)

    def ref_loss(ab, batch):
        merged = _merged(base, ab, ALPHA / RANK)
        params = nnx.State(jax.tree.map(lambda x: x, s0.weights))
        nnx.replace_by_pure_dict(params, merged)
        return loss_fn(params, batch)

    want, grad_fn = [], jax.jit(jax.value_and_grad(ref_loss))
    with model_context(mesh):
        for batch in batches:
            loss, g = grad_fn(ab, batch)
            updates, opt = tx.update(g, opt, ab)
            ab = optax.apply_updates(ab, updates)
            want.append(float(loss))
    np.testing.assert_allclose(losses, want, rtol=2e-5)
    assert losses[-1] < losses[0]  # it learns
    got = nnx.to_pure_dict(state.adapters)["layers"]
    for n in _MERGE:
        np.testing.assert_allclose(got[f"{n}_lora_b"], ab[n]["b"], rtol=1e-3, atol=1e-6)


def test_only_adapters_train_and_hold_optimizer_state():
    """The base comes out bit-identical; opt_state's moments mirror the adapters, nothing else
    (no moment of a base weight exists anywhere in the state)."""
    cfg = tiny_config(**LORA)
    mesh, _, state, step, _ = _setup(cfg, jax.devices()[:1])
    base = jax.device_get(state.weights)
    lora0 = jax.device_get(state.adapters)
    with model_context(mesh):
        for batch in _batches(cfg, 2):
            state, _ = step(state, batch)
    assert tree_equal(state.weights, base)
    assert not tree_equal(state.adapters, lora0)
    assert set(state.variables) == {Role.FROZEN, Role.ADAPTER}
    assert set(state.to_saved()) == {"step", "params", "lora", "opt_state"}  # on disk
    adam = state.opt_state[-1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    names = lambda t: {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(t)}  # noqa: E731
    assert names(adam.mu) == names(adam.nu) == names(state.adapters)
    assert all("lora_" in n for n in names(adam.mu))
    n_base = sum(x.size for x in jax.tree.leaves(state.weights))
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    # two moments per adapter element, plus scalar step counts
    assert n_opt <= 2 * sum(x.size for x in jax.tree.leaves(state.adapters)) + 4 < n_base


@functools.cache
def _one_device(dropout: float = 0.0):
    """(mesh, initial state, jitted train step, jitted eval step) of the LoRA model on one
    device, compiled once per lora.dropout. Step a copy of the state (_run_copy): the train
    step donates it."""
    cfg = tiny_config(**LORA, **{"lora.dropout": dropout})
    mesh, _, state, step, eval_fn = _setup(cfg, jax.devices()[:1])
    return mesh, state, step, eval_fn


def _run_copy(setup, batches) -> list[float]:
    """The losses of _one_device's step over batches, from a copy of its initial state."""
    mesh, state, step, _ = setup
    losses = []
    with model_context(mesh):
        state = jax.tree.map(jnp.copy, state)
        for batch in batches:
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    return losses


@functools.cache
def _one_device_losses(dropout: float = 0.0) -> tuple[float, ...]:
    """Two steps of the LoRA model on one device: what every layout must give."""
    cfg = tiny_config(**LORA, **{"lora.dropout": dropout})
    return tuple(_run_copy(_one_device(dropout), _batches(cfg, 2)))


def test_fsdp_by_tensor_equals_one_device():
    cfg = tiny_config(**LORA)
    batches, one = _batches(cfg, 2), _one_device_losses()
    sharded = apply_overrides(cfg, {"mesh.fsdp": 2, "mesh.tensor": 2, "mesh.data": 1})
    four, state = _train(sharded, jax.devices()[:4], batches)
    np.testing.assert_allclose(four, one, rtol=1e-5)
    a = state.adapters["layers"]["wq_lora_a"].get_value()  # A [L, embed, r]: embed on fsdp
    b = state.adapters["layers"]["wq_lora_b"].get_value()  # B [L, r, heads, hd]: heads on tensor
    assert "fsdp" in str(a.sharding.spec) and "tensor" in str(b.sharding.spec)


def test_gpipe_sums_the_adapters_gradients_over_its_ticks():
    """The pipeline treats non-Param layer Variables as fp8 histories (a maximum over ticks)
    unless they are marked trained, as LoRA is: two stages equal one device."""
    cfg = tiny_config(**LORA)
    batches, one = _batches(cfg, 2), _one_device_losses()
    staged = apply_overrides(cfg, {"mesh.pipeline": 2, "mesh.data": 1,
                                   "pipeline.schedule": "gpipe", "pipeline.microbatches": 2})
    two, _ = _train(staged, jax.devices()[:2], batches)
    np.testing.assert_allclose(two, one, rtol=1e-5)


def test_grad_accum_under_full_remat_equals_one_batch():
    """train.grad_accum=2 with execution.remat=full (where a dense model sums its gradients in
    place, models/accumulate.py): the adapters' sum is the plain one, and the step equals one
    pass over the whole batch."""
    cfg = tiny_config(**LORA, **{"execution.remat": "full"})
    batches = _batches(cfg, 2)
    one, _ = _train(cfg, jax.devices()[:1], batches)
    two, _ = _train(apply_overrides(cfg, {"train.grad_accum": 2}), jax.devices()[:1], batches)
    np.testing.assert_allclose(two, one, rtol=1e-5)


def _size(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_lora_starts_from_a_checkpoint_without_adapters_and_resumes(tmp_path):
    """An imported model's state is a checkpoint without adapters: LoRA takes it as the frozen
    base (fresh adapters and optimizer state); its own checkpoints hold the adapters and name
    that base (checkpoint/lora_base.py), which outlives checkpoint.keep; it resumes them;
    another rank is refused naming the field; sampling and export read the base through the
    reference; a base that is gone is one clear error and quarantines nothing."""
    every = {"checkpoint.every_steps": 1, "checkpoint.async_save": False, "checkpoint.keep": 2}
    run_small(tmp_path, 1, **every)  # the base: step 1, no adapters
    lora = {**every, "lora.rank": RANK}
    first, log = run_small(tmp_path, 3, **lora)
    assert "frozen base of new rank-4 LoRA adapters" in log and first.final_step == 3, log
    again, log = run_small(tmp_path, 4, **lora)
    assert "resumed" in log and "LoRA adapters" not in log and again.final_step == 4, log
    ckpts = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [1, 3, 4]
    for step in (3, 4):  # keep=2, and the base they name
        assert (ckpts / str(step) / "lora_base").is_dir()
        assert _size(ckpts / str(step)) < _size(ckpts / "1") / 3  # adapters, not the base
    with pytest.raises(ConfigError, match=r"lora\.rank: 4 -> 8"):
        run_small(tmp_path, 5, **{**lora, "lora.rank": 8})
    _, _, base, _ = load_for_inference(tmp_path, step=1)
    cfg, graphdef, tuned, _ = load_for_inference(tmp_path, step=4)
    params, adapters = nnx.split_state(tuned, nnx.Param, ...)
    assert tree_equal(params, base)  # the base weights, bit for bit
    assert jax.tree.leaves(adapters) and cfg.lora.rank == RANK
    tokens = jnp.arange(16, dtype=jnp.int32)[None]
    with_adapters, _ = nnx.merge(graphdef, tuned)(tokens)
    b_zero = jax.tree.map(lambda x: x, tuned)
    for path, v in nnx.to_flat_state(b_zero):
        if path[-1].endswith("_lora_b"):
            v.set_value(jnp.zeros_like(v.get_value()))
    without, _ = nnx.merge(graphdef, b_zero)(tokens)
    assert not np.allclose(np.asarray(with_adapters), np.asarray(without))
    export_hf(tmp_path, tmp_path / "merged", progress=False)  # its params read from step 1
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()

    shutil.move(ckpts / "1", tmp_path / "moved_away")
    with pytest.raises(MissingBase, match=r"frozen base .*checkpoints/1, which is gone"):
        run_small(tmp_path, 5, **lora)
    with pytest.raises(FileNotFoundError, match="which is gone"):
        load_for_inference(tmp_path, step=4)
    assert sorted(p.name for p in ckpts.iterdir() if p.name[0].isdigit()) == ["3", "4"]


@pytest.mark.parametrize("over, field", [
    ({"train.offload_optimizer": True}, "train.offload_optimizer"),
    ({"lora.dropout": 1.0}, "lora.dropout"),
    ({"lora.targets": "q,query"}, "lora.targets"),
    ({"mesh.pipeline": 2, "pipeline.schedule": "1f1b", "pipeline.microbatches": 2},
     "pipeline.schedule"),
])
def test_what_lora_cannot_run_with_is_refused_in_one_line(over, field):
    with pytest.raises(ConfigError) as e:
        tiny_config(**{"lora.rank": RANK, **over})
    assert str(e.value).startswith(f"{field}:") and "\n" not in str(e.value)


DROPOUT = {**LORA, "lora.dropout": 0.5}
# Each adapter's two einsums in one layer, (x A) then (x A) B, in its projection's axes.
_ADAPTER = {"wq": ("bsd,dr->bsr", "bsr,rhk->bshk"), "wk": ("bsd,dr->bsr", "bsr,rhk->bshk"),
            "wv": ("bsd,dr->bsr", "bsr,rhk->bshk"), "wo": ("bshk,hkr->bsr", "bsr,rd->bsd"),
            "w_gate": ("bsd,dr->bsr", "bsr,rf->bsf"), "w_up": ("bsd,dr->bsr", "bsr,rf->bsf"),
            "w_down": ("bsf,fr->bsr", "bsr,rd->bsd")}


def _reference_loss(cfg, base: dict, ab: dict, batch: dict, step=None):
    """The mean NLL in plain jnp (RoPE and the attention core: the model's rope_attention),
    each projection x W + scale (dropout(x) A) B, dropout(x) with the masks dropout_mask
    draws at `step` (None: no dropout, x itself)."""
    m, p, layers = cfg.model, cfg.lora.dropout, base["layers"]

    def proj(layer, name, x, spec):
        y = jnp.einsum(spec, x, layers[name][layer])
        if step is not None:
            keep = dropout_mask(cfg.train.seed, step, layer, name, x.shape, p)
            x = jnp.where(keep, x / (1.0 - p), 0.0)
        first, second = _ADAPTER[name]
        xa = jnp.einsum(first, x, ab[name]["a"][layer])
        return y + ALPHA / RANK * jnp.einsum(second, xa, ab[name]["b"][layer])

    x = base["embed"][batch["inputs"]]
    for layer in range(m.n_layers):
        h = rms_norm(x, layers["attn_norm"]["scale"][layer], m.norm_eps)
        q, k, v = (proj(layer, n, h, "bsd,dhk->bshk") for n in ("wq", "wk", "wv"))
        att, _ = rope_attention(m, cfg.execution, q, k, v, batch["positions"],
                                batch["segment_ids"], None, None)
        x = x + proj(layer, "wo", att, "bshk,dhk->bsd")
        h = rms_norm(x, layers["mlp_norm"]["scale"][layer], m.norm_eps)
        gate, up = (proj(layer, n, h, "bsd,df->bsf") for n in ("w_gate", "w_up"))
        x = x + proj(layer, "w_down", jax.nn.silu(gate) * up, "bsf,df->bsd")
    logits = rms_norm(x, base["final_norm"]["scale"], m.norm_eps) @ base["output"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1).mean()


def test_dropout_step_matches_a_plain_reference_and_eval_drops_nothing():
    """A train step at step 3 with B != 0 (so the masks matter to the loss too): its loss and
    its adapters' gradients (from Adam's first moment after one update from zero: (1 - b1)
    times the clipped gradient) equal the reference's with dropout_mask's masks on each
    adapter's input; the eval step equals the reference without masks."""
    cfg = tiny_config(**DROPOUT)
    mesh, state, step, eval_fn = _one_device(cfg.lora.dropout)
    state = jax.tree.map(jnp.copy, state)
    pure = nnx.to_pure_dict(state.adapters)
    rng = np.random.default_rng(2)
    for name, v in pure["layers"].items():
        if name.endswith("_lora_b"):  # placed as the step's own, so it compiles no new variant
            pure["layers"][name] = jax.device_put(rng.normal(0, 1.0, v.shape).astype(np.float32),
                                                  v.sharding)
    nnx.replace_by_pure_dict(state.adapters, pure)
    state = state.replace(step=state.step + 3)
    base, batch = nnx.to_pure_dict(state.weights), _batches(cfg, 1)[0]
    ab = {n: {"a": pure["layers"][f"{n}_lora_a"], "b": pure["layers"][f"{n}_lora_b"]}
          for n in _ADAPTER}
    ref = functools.partial(_reference_loss, cfg, base)
    with model_context(mesh):
        total, tokens = eval_fn(state, batch)
        want_eval = jax.jit(ref)(ab, batch)
        want, want_grads = jax.jit(jax.value_and_grad(ref), static_argnums=2)(ab, batch, 3)
        state, metrics = step(state, batch)
    np.testing.assert_allclose(float(total / tokens), float(want_eval), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)
    # the masks change the loss by far more than the tolerance above
    assert abs(float(want) - float(want_eval)) > 1e-4 * float(want)
    adam = jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))[0]
    mu = nnx.to_pure_dict(adam.mu)["layers"]
    clip = max(1.0, float(metrics["grad_norm"]) / cfg.optim.clip_norm)  # optax's clipping
    for n in _ADAPTER:
        for f in ("a", "b"):
            got, ref_g = mu[f"{n}_lora_{f}"] * clip / (1 - cfg.optim.b1), want_grads[n][f]
            np.testing.assert_allclose(got, ref_g, rtol=1e-4,
                                       atol=1e-5 * float(jnp.abs(ref_g).max()))


def test_dropout_changes_training_repeats_exactly_and_leaves_eval_alone():
    """Dropout changes what the adapters learn (step 0's loss is the base model's: B = 0);
    the same state and batches give the same masks again (they come from train.seed and the
    step); the eval step at step 0 gives the train step's loss (no dropout in eval)."""
    cfg = tiny_config(**DROPOUT)
    setup, batches = _one_device(cfg.lora.dropout), _batches(cfg, 2)
    mesh, state, _, eval_fn = setup
    with model_context(mesh):
        total, tokens = eval_fn(state, batches[0])
    first, again = _one_device_losses(cfg.lora.dropout), _run_copy(setup, batches)
    assert list(first) == again
    without = _one_device_losses()
    np.testing.assert_allclose(first[0], [float(total / tokens), without[0]], rtol=1e-6)
    assert abs(first[1] - without[1]) > 1e-5 * abs(without[1])


def test_dropout_fsdp_by_tensor_equals_one_device():
    """The masks come from each token's key: sharding the batch, sequence or features over
    fsdp x tensor draws the same ones."""
    cfg = tiny_config(**DROPOUT)
    batches, one = _batches(cfg, 2), _one_device_losses(0.5)
    sharded = apply_overrides(cfg, {"mesh.fsdp": 2, "mesh.tensor": 2, "mesh.data": 1})
    four, _ = _train(sharded, jax.devices()[:4], batches)
    np.testing.assert_allclose(four, one, rtol=1e-5)


def test_dropout_masks_follow_the_tokens_through_pipeline_and_grad_accum():
    """gpipe over two stages with two pipeline microbatches, inside train.grad_accum=2: each
    token keeps its masks whichever microbatch it lands in, so the run equals one device."""
    cfg = tiny_config(**DROPOUT)
    batches, one = _batches(cfg, 2), _one_device_losses(0.5)
    staged = apply_overrides(cfg, {"mesh.pipeline": 2, "mesh.data": 1, "train.grad_accum": 2,
                                   "pipeline.schedule": "gpipe", "pipeline.microbatches": 2})
    two, _ = _train(staged, jax.devices()[:2], batches)
    np.testing.assert_allclose(two, one, rtol=1e-5)


def test_a_copied_or_moved_lora_run_keeps_and_finds_its_own_base(tmp_path):
    """A LoRA run's steps name its own base relative to their folder (checkpoint/lora_base.py):
    a copy (cp -a) rotates its own steps with `keep` and never its base, and a moved run
    resumes on the base in its new place. Before, the absolute path sent a copy's rotation
    past its base (the guard compared folders) and a moved run to "frozen base ... is gone"."""
    every = {"checkpoint.every_steps": 1, "checkpoint.async_save": False, "checkpoint.keep": 1}
    run_dir = tmp_path / "run"
    run_small(run_dir, 1, **every)  # the base: step 1
    lora = {**every, "lora.rank": RANK}
    run_small(run_dir, 2, **lora)
    copy, moved = tmp_path / "copy", tmp_path / "moved"
    shutil.copytree(run_dir, copy, symlinks=True)
    shutil.move(run_dir, moved)
    for folder in (copy, moved):
        result, log = run_small(folder, 4, **lora)
        assert "resumed" in log and result.final_step == 4, log
        steps = sorted(int(p.name) for p in (folder / "checkpoints").iterdir()
                       if p.name.isdigit())
        assert steps == [1, 4], (folder, steps)  # keep=1, and the base step 4 names
    _, _, base, _ = load_for_inference(moved, step=1)
    _, _, tuned, _ = load_for_inference(moved, step=4)
    params, _ = nnx.split_state(tuned, nnx.Param, ...)
    assert tree_equal(params, base)


def test_a_base_reference_written_before_relative_ones_follows_a_moved_run(tmp_path):
    from titanax.checkpoint.lora_base import BaseRef

    here = tmp_path / "new" / "checkpoints"
    (here / "1" / "state").mkdir(parents=True)
    other = tmp_path / "other" / "checkpoints"
    (other / "1" / "state").mkdir(parents=True)
    assert BaseRef(here, 1).to_json(here) == {"directory": ".", "step": 1}
    assert BaseRef(other, 1).to_json(here) == {"directory": str(other), "step": 1}
    assert BaseRef.from_json({"directory": ".", "step": 1}, here).directory == here
    # Old absolute references: the run's old place is gone, its own step is here.
    gone = tmp_path / "old" / "checkpoints"
    assert BaseRef.from_json({"directory": str(gone), "step": 1}, here).directory == here
    # Another run's base that still exists stays that run's.
    assert BaseRef.from_json({"directory": str(other), "step": 1}, here).directory == other
