import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.helpers.small import ROOT, SMALL, single_device_step, small_config
from titanax.config import apply_overrides
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import model_context
from titanax.train.optim import (
    clip_by_global_norm,
    decay_mask,
    lr_schedule,
    make_optimizer,
    update_rule,
)
from titanax.train.resolved import resolve
from titanax.train.state import create_train_state

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices






def test_short_training_run_loss_falls(tmp_path):
    from titanax.train.loop import train

    cfg = small_config(**{"train.steps": 80, "train.log_every": 5, "train.eval_every": 40,
                          "optim.warmup_steps": 5, "train.progress_bar": False,
                          "checkpoint.every_steps": 0})
    result = train(cfg, tmp_path, log=lambda *_: None, devices=jax.devices()[:1])
    assert result.final_step == 80
    assert result.val_losses[80] < 0.85 * result.val_losses[0]  # ln(512)=6.24 -> about 4.9
    first, last = result.losses[5], result.losses[80]
    assert last < first - 1.0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu"} <= set(logged[0])
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in logged)
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "80").is_dir()


def _random_batch(cfg):
    """One batch of random tokens, one document per row."""
    rng = np.random.default_rng(0)
    B, S = cfg.train.batch_size, cfg.train.seq_len
    toks = rng.integers(0, cfg.model.vocab_size, (B, S + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:],
            "segment_ids": np.ones((B, S), np.int32),
            "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))}


def _one_step(cfg):
    mesh, state, step = single_device_step(cfg)
    batch = _random_batch(cfg)
    with model_context(mesh):
        new_state, metrics = step(state, batch)
    return new_state, metrics


def test_gradient_accumulation_matches_one_big_batch():
    """grad_accum=4 gives the big batch's mean loss and gradients. Compared where the claim is:
    the loss and the gradients, not the weights after AdamW, whose first step turns a near-zero
    gradient into lr x its sign (one of 98,304 weights 1.5e-6 off on an AVX-512 Xeon). The
    gradients are float32 sums of the same terms in another order: a few ulp of the largest
    term, checked at 1e-5 of each tensor's largest gradient."""
    from titanax.train import step as train_step

    base = small_config(**{"execution.dtype": "float32"})
    mesh = build_mesh(base.mesh, devices=jax.devices()[:1])
    graphdef, state, _ = create_train_state(base, mesh, make_optimizer(base))
    batch = _random_batch(base)
    out = {}
    for accum in (1, 4):
        cfg = apply_overrides(base, {"train.grad_accum": accum})
        loss_fn = train_step.make_loss_fn(cfg, graphdef, resolve(cfg).spec,
                                             with_metrics=True)
        with model_context(mesh):
            out[accum] = jax.jit(lambda p, b, cfg=cfg, f=loss_fn: train_step._grads(
                cfg, f, p, {}, b)[:2])(state.weights, batch)
    (loss1, g1), (loss4, g4) = out[1], out[4]
    np.testing.assert_allclose(loss4, loss1, rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g4), jax.tree.leaves(g1)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), jax.tree_util.keystr(path)
    # The whole step with accumulation runs and reports the same loss.
    _, m4 = _one_step(apply_overrides(base, {"train.grad_accum": 4}))
    np.testing.assert_allclose(m4["loss"], loss1, rtol=1e-5)


def test_no_weight_decay_on_norms_and_schedule_shape():
    cfg = small_config(**{"train.steps": 100, "optim.warmup_steps": 10})
    _, state, _ = create_train_state(cfg, build_mesh(cfg.mesh, devices=jax.devices()[:1]),
                                     make_optimizer(cfg))
    mask = decay_mask(state.weights)
    assert mask["final_norm"]["scale"].get_value() is False
    assert mask["layers"]["attn_norm"]["scale"].get_value() is False
    assert mask["layers"]["wq"].get_value() is True and mask["embed"].get_value() is True
    # an architecture's own rule (ModelSpec.no_decay) decides instead, given the names
    only_embed = decay_mask(state.weights, no_decay=lambda path: path != ("embed",))
    assert only_embed["embed"].get_value() is True
    assert only_embed["layers"]["wq"].get_value() is False
    lr = lr_schedule(cfg)
    peak, floor = cfg.optim.lr, cfg.optim.lr * cfg.optim.min_lr_ratio
    assert float(lr(0)) == pytest.approx(peak / 10)
    assert float(lr(10)) == pytest.approx(peak, rel=1e-3)
    assert float(lr(100)) == pytest.approx(floor, rel=1e-3)
    assert float(lr(55)) < peak



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optimizer_table_matches_the_state_and_optax(dtype):
    """The table's state bytes (what plan/memory_model.py charges) are the optimizer state's,
    and its clipping is optax.clip_by_global_norm to the bit (train/offload.py clips with it)."""
    import jax.numpy as jnp
    import optax

    cfg = small_config(**{"optim.clip_norm": 0.5})
    params = {"w": jnp.ones((6, 4), dtype), "norm": {"scale": jnp.ones((4,), dtype)}}
    state = make_optimizer(cfg).init(params)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim)  # counts: scalars
    itemsize = jnp.dtype(dtype).itemsize
    assert state_bytes == 28 * update_rule(cfg).state_bytes(itemsize)
    grads = {"w": jnp.arange(24.0, dtype=dtype).reshape(6, 4), "norm": {"scale": -params["norm"]["scale"]}}
    ours = clip_by_global_norm(0.5).update(grads, optax.EmptyState())[0]
    theirs = optax.clip_by_global_norm(0.5).update(grads, optax.EmptyState())[0]
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _run(args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, **kw)


def test_cli_train_resume_and_generate(tmp_path):
    sets = [f"--set={k}={v}" for k, v in SMALL.items() if k != "mesh.data"]
    sets += ["--set=train.log_every=5", "--set=train.eval_every=10",
             "--set=checkpoint.every_steps=10", "--set=optim.warmup_steps=2"]
    work = tmp_path / "run"
    r = _run(["launch.train", "--config", "configs/tiny.gin", "--workdir", str(work),
              "--host-devices", "2", "--set=train.steps=10", *sets])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FLOPs/token = 6*N + 12*L*d*S" in r.stdout
    assert "data=2" in r.stdout  # two simulated devices, data parallel
    # Same workdir, more steps: resumes from step 10 on its own.
    r = _run(["launch.train", "--config", "configs/tiny.gin", "--workdir", str(work),
              "--host-devices", "2", "--set=train.steps=15", *sets])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 10" in r.stdout
    steps = [json.loads(x)["step"] for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(10) >= 1 and max(steps) == 15
    r = _run(["launch.generate", "--workdir", str(work), "--prompt", "def f(x):",
              "--max-new-tokens", "8", "--temperature", "0.7"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("def f(x):") and len(r.stdout) > len("def f(x):\n")


def test_cli_reports_config_errors_without_traceback(tmp_path):
    r = _run(["launch.train", "--set", "train.stesp=3", "--workdir", str(tmp_path)])
    assert r.returncode == 2
    assert "Did you mean 'train.steps'" in r.stderr and "Traceback" not in r.stderr
    r = _run(["launch.generate", "--workdir", str(tmp_path / "nothing"), "--prompt", "x"])
    assert r.returncode == 2 and "no checkpoint" in r.stderr


def test_plot_runs_draws_several_runs_and_names_a_bad_folder(tmp_path):
    for name, loss in (("a", 5.0), ("b", 4.0)):
        (tmp_path / name).mkdir()
        rows = [{"step": 0, "val_loss": loss + 1}, {"step": 10, "loss": loss},
                {"step": 10, "val_loss": loss}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp.png"
    r = _run(["launch.plot_runs", str(out), f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"])
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = _run(["launch.plot_runs", str(out), f"c={tmp_path / 'missing'}"])
    assert r.returncode == 2 and "no metrics.jsonl rows" in r.stderr

