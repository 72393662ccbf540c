"""Sampling restores the parameters only (checkpoint/params_only.py): host memory grows by the
weights, not by the weights and Adam's two moments, and the weights land sharded over the local
devices.

Also a script that writes a run to measure launch.generate on (the README's number):
    python tests/test_generate_memory.py DIR [--set section.field=value ...]
a freshly initialised train state (125M parameters by default, never trained) saved with the
training Checkpointer, and a small BPE tokenizer."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

ROOT = pathlib.Path(__file__).resolve().parent.parent
# d_model 768, 12 layers, vocab 32000: 124,668,672 parameters (498.7 MB of float32).
BIG = {"model.d_model": 768, "model.n_layers": 12, "model.n_heads": 12, "model.n_kv_heads": 4,
       "model.ffn_dim": 2048, "model.vocab_size": 32000, "data.source": "synthetic"}
# 41.6M parameters (166 MB): big enough that the optimizer state (332 MB) stands far out of the
# allocator's noise, small enough to write in a few seconds.
MEDIUM = {"model.d_model": 512, "model.n_layers": 8, "model.n_heads": 8, "model.n_kv_heads": 4,
          "model.ffn_dim": 1536, "model.vocab_size": 16000, "data.source": "synthetic"}


def make_run(workdir, overrides: dict) -> int:
    """Writes WORKDIR/checkpoints/0 (step, params, Adam state) and WORKDIR/tokenizer.json for
    configs/tiny.py with `overrides`, on one device; returns the parameter bytes."""
    import jax

    from titanax.checkpoint.manager import Checkpointer
    from titanax.config import apply_overrides, load_config
    from titanax.data.tokenizer import train_bpe
    from titanax.parallel.mesh import single_device_mesh
    from titanax.train.optim import make_optimizer
    from titanax.train.state import create_train_state

    workdir = pathlib.Path(workdir)
    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.py"), overrides)
    _, state, _ = create_train_state(cfg, single_device_mesh(), make_optimizer(cfg))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    ckpt.save(0, state.to_saved(), data_state=None, config=cfg.to_dict())
    ckpt.close()
    train_bpe(["def main():\n    return 0\n" * 20, "import os\nprint(os.getcwd())\n" * 20], 300,
              workdir / "tokenizer.json")
    return sum(x.nbytes for x in jax.tree.leaves(state.weights))


# Run in a fresh interpreter: RSS before the restore (jax and titanax imported, the CPU client
# up), then the peak after it. The peak is VmHWM, not getrusage's ru_maxrss: Linux carries
# ru_maxrss across exec from the forked parent, so a child of a big pytest process would
# report the parent's size.
_MEASURE = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from titanax.generate import load_for_inference

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    jnp.zeros(8).block_until_ready()
    before = status("VmRSS")
    cfg, graphdef, params, step = load_for_inference(sys.argv[1])
    print(json.dumps({"before": before, "peak": status("VmHWM"),
                      "params": sum(x.nbytes for x in jax.tree.leaves(params))}))
""")


def test_restoring_for_sampling_grows_memory_by_the_params_not_the_train_state(tmp_path):
    env_code = "import os; os.environ['JAX_PLATFORMS'] = 'cpu'\n"
    r = subprocess.run([sys.executable, "-c",
                        env_code + f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                        "from test_generate_memory import make_run, MEDIUM\n"
                        f"print(make_run({str(tmp_path / 'run')!r}, MEDIUM))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    param_bytes = int(r.stdout.split()[-1])
    # glibc keeps freed blocks under its (self-raising) mmap threshold in the heap, so RSS would
    # count its cache of the restore's temporaries; a fixed 1 MB threshold returns them.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    r = subprocess.run([sys.executable, "-c", env_code + _MEASURE, str(tmp_path / "run")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.splitlines()[-1])
    assert m["params"] == param_bytes
    grown = m["peak"] - m["before"]
    # Measured 1.4x (the params, and a few parameters' reads in flight); restoring the whole
    # train state keeps 3x alive (the weights and two Adam moments) and peaked at 3.5x.
    assert grown < 2 * param_bytes, (m, param_bytes)


def test_restore_is_given_no_optimizer_template(tmp_path, monkeypatch):
    import jax
    import orbax.checkpoint as ocp

    from titanax.checkpoint.manager import Checkpointer
    from titanax.generate import load_for_inference

    make_run(tmp_path, {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
                        "model.n_kv_heads": 2, "model.ffn_dim": 128, "model.vocab_size": 512})
    calls = []  # every orbax restore: the manager's (config, metadata) and ours
    real = ocp.Checkpointer.restore

    def spy(self, directory, *a, args=None, **kw):
        calls.append(args)
        return real(self, directory, *a, args=args, **kw)

    def refuse(*_a, **_k):
        raise AssertionError("sampling must not restore the whole train state")

    monkeypatch.setattr(ocp.Checkpointer, "restore", spy)
    monkeypatch.setattr(Checkpointer, "_restore", refuse)
    before = {id(x) for x in jax.live_arrays()}
    _, _, params, _ = load_for_inference(tmp_path)
    trees = [a for a in calls if isinstance(a, ocp.args.PyTreeRestore)]
    assert len(trees) == 1 and set(trees[0].item) == {"params"} and trees[0].partial_restore
    assert not any(isinstance(a, ocp.args.Composite) and "state" in a.keys() for a in calls)
    new = [x for x in jax.live_arrays() if id(x) not in before]
    # Alive afterwards: the parameters, nothing else (no moments, no step counter).
    assert sum(x.nbytes for x in new) == sum(x.nbytes for x in jax.tree.leaves(params))


def test_sampling_shards_over_local_devices_and_samples_the_same(tmp_path):
    import jax
    import numpy as np

    from titanax.generate import generate, load_for_inference

    make_run(tmp_path, {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
                        "model.n_kv_heads": 2, "model.ffn_dim": 128, "model.vocab_size": 512})
    cfg, graphdef, one, _ = load_for_inference(tmp_path)
    _, _, many, _ = load_for_inference(tmp_path, devices=jax.devices())  # 8 in tests
    wq = many["layers"]["wq"].get_value()
    assert wq.sharding.mesh.shape["tensor"] == 2  # kv heads (2) bound tensor parallelism
    assert wq.sharding.mesh.shape["fsdp"] == 4  # the rest shard d_model
    assert math.prod(wq.sharding.shard_shape(wq.shape)) == wq.size // 8
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt = [5, 17, 300]
    assert (list(generate(cfg, graphdef, one, prompt, max_new_tokens=6))
            == list(generate(cfg, graphdef, many, prompt, max_new_tokens=6)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE")
    args = p.parse_args(argv)
    overrides = dict(BIG, **dict(o.split("=", 1) for o in args.overrides))
    n = make_run(args.workdir, overrides)
    print(f"wrote {args.workdir}: {n / 4:,.0f} float32 parameters ({n / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
