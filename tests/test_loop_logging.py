"""The training loop's host side at scale: it reads nothing back from the devices between
logging steps (so the host dispatches ahead), prints a timestamped line per logged step when
there is no progress bar, records step time, memory and wall time, traces a profile window,
purges TensorBoard to the resumed step and loads the compiled step from the compilation cache;
token shard folders record their largest id; the GPU XLA flags are applied in one place."""

import os
import pathlib
import re
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.helpers.small import seed_data, small_config
from titanax import xla_flags
from titanax.data import shards
from titanax.train import loop
from titanax.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

STEPS, LOG_EVERY, SAVE_EVERY = 10, 4, 5
# Steps where the host waits for the devices anyway: logging (and the last), checkpoints.
SYNC_STEPS = {4, 5, 8, 10}
PROFILE = (6, 7)  # the trace waits for step 6 before it starts and step 7 before it ends


class _Probe:
    """A step's metric whose host reads and waits are recorded with the number of steps
    dispatched so far."""

    def __init__(self, value, step, events):
        self.value, self.step, self.events = value, step, events

    def _mark(self, kind):
        self.events.append((kind, self.step, sum(e[0] == "dispatch" for e in self.events)))

    def copy_to_host_async(self):
        self._mark("read")

    def __array__(self, dtype=None, copy=None):
        self._mark("read")
        return np.asarray(self.value, dtype)

    def __int__(self):
        return int(self.__array__())

    def __float__(self):
        return float(self.__array__())

    def block_until_ready(self):
        self._mark("wait")
        return self.value.block_until_ready()


def _instrument(monkeypatch, events):
    real_jit = loop.jit_train_step

    def jit_train_step(*args, **kwargs):
        real = real_jit(*args, **kwargs)

        class Step:
            lower = real.lower

            def __call__(self, state, batch):
                state, metrics = real(state, batch)
                events.append(("dispatch", sum(e[0] == "dispatch" for e in events) + 1, None))
                step = events[-1][1]
                return state, {k: _Probe(v, step, events) for k, v in metrics.items()}

        return Step()

    real_stop = loop.PreemptionWatch.stop_requested

    def stop_requested(self):
        events.append(("stop?", None, sum(e[0] == "dispatch" for e in events)))
        return real_stop(self)

    monkeypatch.setattr(loop, "jit_train_step", jit_train_step)
    monkeypatch.setattr(loop.PreemptionWatch, "stop_requested", stop_requested)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short run, instrumented, with the progress bar on: stdout is not a terminal."""
    work = seed_data(tmp_path_factory.mktemp("run"))
    cfg = small_config(**{"train.steps": STEPS, "train.log_every": LOG_EVERY,
                          "train.eval_every": 0, "checkpoint.every_steps": SAVE_EVERY,
                          "train.progress_bar": True, "optim.warmup_steps": 2,
                          "optim.decay_steps": 50,  # the program does not depend on steps
                          "train.profile_steps": f"{PROFILE[0]}:{PROFILE[1]}"})
    events, lines = [], []
    with pytest.MonkeyPatch.context() as mp:
        _instrument(mp, events)
        loop.train(cfg, work, log=lines.append, devices=jax.devices()[:1])
    return work, events, [str(x) for x in lines]


def test_host_reads_metrics_only_at_logging_and_checkpoint_steps(run):
    _, events, _ = run
    assert [e[1] for e in events if e[0] == "dispatch"] == list(range(1, STEPS + 1))
    reads = [(step, dispatched) for kind, step, dispatched in events if kind == "read"]
    # Every step's metrics are read (skipped-step counting), each only once the host has
    # dispatched up to the next logging or checkpoint step: between those it never waits.
    assert sorted({step for step, _ in reads}) == list(range(1, STEPS + 1))
    for step, dispatched in reads:
        assert dispatched in SYNC_STEPS and dispatched >= step, (step, dispatched, events)
    for k in set(range(1, STEPS)) - SYNC_STEPS:  # step k + 1 goes out before k is read
        assert min(d for s, d in reads if s == k) >= k + 1
    waits = {d for kind, _, d in events if kind == "wait"}
    assert waits == set(PROFILE)
    # The stop flag (a collective with several processes) is agreed at those steps only.
    assert [d for kind, _, d in events if kind == "stop?"] == sorted(SYNC_STEPS - {STEPS})


def test_step_lines_memory_and_times_without_a_bar(run):
    work, _, lines = run
    text = "\n".join(lines)
    assert "train step compiled in" in text and "memory per device:" in text
    assert "temporaries" in text
    pattern = (r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step (\d+)/10 loss \d+\.\d{4} tok/s [\d,]+ "
               r"mfu [\d.]+% step [\d.]+s mem (-|[\d.]+)/(-|[\d.]+) GiB skipped 0$")
    logged = [int(m[1]) for m in (re.match(pattern, x) for x in lines) if m]
    assert logged == [4, 8, 10], text
    assert "step 10: val_loss" in text  # evaluation lines too, bar or not
    rows = [r for r in read_metrics(work) if "loss" in r]
    assert [r["step"] for r in rows] == [4, 8, 10]
    for r in rows:
        assert r["step_time"] > 0 and r["elapsed_s"] > 0 and abs(r["time"] - rows[-1]["time"]) < 600
        assert "mem_in_use" in r and "mem_peak" in r  # None on XLA:CPU, which keeps no stats
    assert rows[0]["elapsed_s"] < rows[1]["elapsed_s"] < rows[2]["elapsed_s"]


def test_profile_window_writes_a_trace(run):
    work, _, lines = run
    traces = list((work / "profile" / "process_0").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    assert any("profile of steps 7-7 written to" in x for x in lines)


def _tb_events(path: pathlib.Path):
    """The Event protos of one TFRecord event file."""
    from tensorboardX.proto import event_pb2

    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
        i += 12 + n + 4
    return out


def test_resume_purges_tensorboard_and_loads_the_compiled_step(run):
    work, _, _ = run
    hits = []
    listener = lambda event, **_: hits.append(event)  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    try:
        cfg = small_config(**{"train.steps": STEPS + 2, "train.log_every": LOG_EVERY,
                              "train.eval_every": 0, "checkpoint.every_steps": 0,
                              "train.progress_bar": False, "optim.warmup_steps": 2,
                              "optim.decay_steps": 50})
        lines = []
        loop.train(cfg, work, log=lines.append, devices=jax.devices()[:1])
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert any(f"at step {STEPS}" in str(x) for x in lines)
    # The train step (and the rest) came from WORKDIR/xla_cache: a miss would add an entry.
    assert hits.count("/jax/compilation_cache/cache_hits") >= 2, hits
    assert len(list((work / "xla_cache").glob("jit_train_step-*"))) == 1
    newest = max((work / "tb").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    starts = [e.step for e in _tb_events(newest) if e.HasField("session_log")]
    assert starts == [STEPS + 1]  # TensorBoard hides the old run's events from step 11 on
    assert jax.config.jax_compilation_cache_dir is None  # the process's setting is back


# --- token shard folders: the largest id is recorded, start-up reads no tokens ---------------

class _CharTokenizer:
    def encode_batch(self, texts):
        return [[ord(c) for c in t] for t in texts]


def test_shard_folder_records_largest_id_and_old_folders_are_read_once(tmp_path, capsys):
    out = tmp_path / "shards"
    out.mkdir()
    meta = {"format": shards.FORMAT, "version": shards.VERSION, "vocab_size": 100,
            "eos_id": 0, "bos_id": None, "shards": [], "done_inputs": [], "partial_input": None}
    writer = shards._ShardWriter(out, meta, shard_tokens=8, eos_id=0)
    writer.add([("doc", "a", 1, "abcdefgh"), ("doc", "a", 2, "xyz~"), ("end", "a", None, None)],
               _CharTokenizer())
    writer.flush()
    recorded = [e["max_id"] for e in shards.read_meta(out)["shards"]]
    assert recorded == [ord("h"), ord("~")]

    # A folder from before max_id: read once (with a message), then recorded.
    old = shards.read_meta(out)
    for entry in old["shards"]:
        del entry["max_id"]
    shards.write_json_atomic(out / shards.META, old)
    shards.open_shards(out, vocab_size=300)
    assert "reading their 14 tokens once" in capsys.readouterr().err
    assert [e["max_id"] for e in shards.read_meta(out)["shards"]] == recorded
    # From then on the tokens are not read: an id the meta does not know about goes unseen,
    # while the recorded one is still checked.
    shards.save_npy_atomic(out / "shard_00001.npy", np.array([1, 2, 999, 3, 0], np.uint32))
    shards.open_shards(out, vocab_size=300)
    assert "reading" not in capsys.readouterr().err
    with pytest.raises(shards.DataError, match=r"shard_00000.npy: max id 104 is outside"):
        shards.open_shards(out, vocab_size=100)


# --- GPU XLA flags ----------------------------------------------------------------------------

def test_gpu_xla_flags_reach_xla_flags_for_a_gpu_run_only(monkeypatch):
    lhs = "--xla_gpu_enable_latency_hiding_scheduler"
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": f"{lhs}=false"}
    assert xla_flags.apply_for_run(0, env)
    flags = env["XLA_FLAGS"].split()
    assert set(xla_flags.GPU_FLAGS) - set(flags) == {f"{lhs}=true"}
    assert flags[-1] == f"{lhs}=false"  # the user's own setting wins
    for cpu in ({"JAX_PLATFORMS": "cpu"}, {"JAX_PLATFORMS": "cuda", "_host_devices": 2}):
        env = dict(cpu, XLA_FLAGS="--xla_dump_to=/tmp/x")
        assert not xla_flags.apply_for_run(env.pop("_host_devices", 0), env)
        assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    only = "--xla_gpu_enable_pipelined_all_gather=false"
    env = {"JAX_PLATFORMS": "cuda", xla_flags.OVERRIDE_ENV: only}
    xla_flags.apply_for_run(0, env)
    assert env["XLA_FLAGS"] == only

    # launch.train applies them before jax starts, on GPU only.
    import launch.train

    seen = []
    monkeypatch.setattr(launch.train, "setup_jax",
                        lambda *a: seen.append(os.environ.get("XLA_FLAGS", "")) or sys.exit(0))
    for platforms, host_devices in (("cuda", []), ("cpu", []), ("cuda", ["--host-devices", "2"])):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        monkeypatch.setenv("XLA_FLAGS", "")
        with pytest.raises(SystemExit):
            launch.train.main(host_devices)
    assert [(f"{lhs}=true" in s) for s in seen] == [True, False, False]

    # launch.plan's deviceless GPU compiles get them; its simulated-CPU compiles do not.
    from titanax.plan import compile as plan_compile
    from titanax.plan.cluster import Cluster

    monkeypatch.setenv("XLA_FLAGS", "")
    for plugin, want in ((True, True), (False, False)):
        monkeypatch.setattr(plan_compile.aot, "plugin_available", lambda p=plugin: p)
        env, target = plan_compile._worker_env(Cluster("h100", 1, 8))
        assert target == ("gpu" if plugin else "cpu")
        assert (f"{lhs}=true" in env.get("XLA_FLAGS", "")) == want


def test_gpu_xla_flags_exist_in_this_jaxlib():
    """An unknown flag in XLA_FLAGS aborts XLA at start-up; XLA parses its GPU flags on every
    platform, so a CPU checks the names."""
    env = dict(os.environ, XLA_FLAGS=" ".join(xla_flags.GPU_FLAGS), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_collective_dtypes_reads_combined_collectives():
    """The GPU flags' combiners turn a layer's gradient reduce-scatters into one instruction
    over a tuple, whose shape text holds /*index=5*/ comments; its types still count."""
    from titanax.plan.compile import collective_dtypes

    hlo = """
  %rs = ((bf16[64,8]{1,0}, bf16[64,8]{1,0}, bf16[64,8]{1,0}, bf16[64,8]{1,0}, bf16[64,4]{1,0}, /*index=5*/bf16[64,4]{1,0}), (bf16[8,8]{1,0}, bf16[8,8]{1,0}, bf16[8,8]{1,0}, bf16[8,8]{1,0}, bf16[8,4]{1,0}, /*index=5*/bf16[8,4]{1,0})) reduce-scatter-start(%a, %b, %c, %d, %e, %f), channel_id=3, dimensions={0}
  %ar = (f32[8]{0}, bf16[4]{0}) all-reduce-start(%g, %h), channel_id=4, to_apply=%add
  %done = bf16[8,8]{1,0} reduce-scatter-done(%rs)
  %ag = f32[64]{0} all-gather(%i), dimensions={0}
"""
    assert collective_dtypes(hlo) == {"reduce-scatter": {"bf16": 1},
                                      "all-reduce": {"f32": 1, "bf16": 1},
                                      "all-gather": {"f32": 1}}
