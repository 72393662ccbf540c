"""Checkpoint integrity at scale (checkpoint/integrity.py): each process checksums the files it
wrote in the background, the manifest is the union of the per-process parts, each process
verifies its share before a resume, and a preempted run never waits for checksums.

The 2-process tests start real processes (jax.distributed over 127.0.0.1, CPU devices); this
module is also their worker: `python -m tests.test_checkpoint_integrity save|resume DIR PORT I`.
"""

import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest

from tests.helpers.processes import SETS, free_port, logged_steps, wait_all
from tests.helpers.small import ROOT, seed_data
from titanax.checkpoint import integrity

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

ROWS, COLS = 512, 256  # each array 512 KB of float32, sharded by rows over 4 devices


def _env():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in [k for k in env if k.startswith(("SLURM_", "TITANAX_", "JAX_COORDINATOR"))]:
        del env[k]  # a test run inside a SLURM job must not take the job's settings
    return env


# ---------------------------------------------------------------- in one process, no jax


def _fake_step(folder: pathlib.Path) -> pathlib.Path:
    """A step folder laid out as orbax writes one with 2 processes."""
    files = {"_CHECKPOINT_METADATA": b"{}", "state/_METADATA": b"m" * 300,
             "state/manifest.ocdbt": b"o" * 50, "state/array_metadatas/process_0": b"a" * 40,
             "state/array_metadatas/process_1": b"b" * 40,
             "state/ocdbt.process_0/d/aa": os.urandom(3 << 20),
             "state/ocdbt.process_1/d/bb": os.urandom(3 << 20), "config/metadata": b"{}"}
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def test_parts_merge_into_the_manifest_and_each_share_is_verified(tmp_path):
    step = _fake_step(tmp_path / "7")
    assert integrity.owner("state/ocdbt.process_1/d/bb", 2) == 1
    assert integrity.owner("state/array_metadatas/process_0", 2) == 0
    assert integrity.seal(step, 1, 2)["files"] >= 2
    assert not integrity.has_manifest(step)  # process 0's part is missing
    assert set(integrity.load_manifest(step)) >= {"state/ocdbt.process_1/d/bb"}
    integrity.seal(step, 0, 2)
    manifest = json.loads((step / integrity.MANIFEST).read_text())
    on_disk = {p.relative_to(step).as_posix() for p in step.rglob("*")
               if p.is_file() and not p.name.startswith("titanax_manifest")}
    assert set(manifest["files"]) == on_disk and manifest["processes"] == 2
    assert all(f["crc32"] is not None for f in manifest["files"].values())

    # Damage in process 1's share is found by process 1 only; any count of verifiers works.
    victim = step / "state/ocdbt.process_1/d/bb"
    data = bytearray(victim.read_bytes())
    data[12345] ^= 1
    victim.write_bytes(bytes(data))
    assert integrity.find_damage(step, 0, 2) is None
    assert integrity.find_damage(step, 1, 2) == \
        "state/ocdbt.process_1/d/bb does not match its checksum"
    assert "does not match" in integrity.find_damage(step)  # 1 process: everything
    (step / "state/ocdbt.process_0/d/aa").write_bytes(b"short")
    assert integrity.find_damage(step, 0, 2) == \
        f"state/ocdbt.process_0/d/aa has 5 bytes, {3 << 20} were written"


def test_a_stop_leaves_sizes_only(tmp_path):
    step = _fake_step(tmp_path / "3")
    stop = threading.Event()
    stop.set()
    got = integrity.seal(step, 0, 1, stop=stop)
    assert got["checksummed"] == 0 and got["bytes"] > 6 << 20
    files = integrity.load_manifest(step)
    assert all(f["crc32"] is None for f in files.values())
    victim = step / "state/ocdbt.process_0/d/aa"
    victim.write_bytes(b"\0" * victim.stat().st_size)
    assert integrity.find_damage(step) is None  # same size, no checksum: the restore decides
    victim.write_bytes(b"\0")
    assert "has 1 bytes" in integrity.find_damage(step)


# ------------------------------------------------ 2 processes: save, damage, verify, resume


def _worker(mode: str, folder: str, port: int, index: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    from titanax import distributed

    distributed.initialize(distributed.ProcessSpec(f"127.0.0.1:{port}", 2, index, None, "test"),
                           heartbeat_timeout_s=30)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from titanax.checkpoint.manager import Checkpointer
    from titanax.config import CheckpointConfig

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))

    def tree(step):  # a train state of 3 arrays, each row block on one device
        def array(k):
            full = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) * (step + k)
            return jax.make_array_from_callback(full.shape, sharding, lambda i: full[i])
        return {"params": array(0), "mu": array(1), "nu": array(2)}

    ckpt = Checkpointer(folder, CheckpointConfig(keep=3))
    if mode == "save":
        for step in (1, 2):
            ckpt.save(step, tree(step), data_state=None, config={})
        ckpt.close()
        return
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            tree(0))
    got = ckpt.restore_latest_good(abstract, log=lambda m: print(f"LOG {m}", flush=True))
    want = tree(got.step)
    same = all(np.array_equal(a.addressable_shards[0].data, b.addressable_shards[0].data)
               for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(want)))
    print(f"RESTORED {got.step} {'same' if same else 'DIFFERENT'}", flush=True)
    ckpt.close()


def _run_pair(mode: str, folder: pathlib.Path) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_checkpoint_integrity", mode,
                               str(folder), str(port), str(i)], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()  # only if one hung: no process outlives the test
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    return outs


def test_two_processes_checksum_their_own_files_and_damage_is_found(tmp_path):
    _run_pair("save", tmp_path)
    step = tmp_path / "2"
    parts = {i: json.loads((step / integrity.part_name(i, 2)).read_text())["files"]
             for i in range(2)}
    for i, files in parts.items():  # each process checksummed what it wrote: its ocdbt folder
        assert any(f"ocdbt.process_{i}/" in rel for rel in files), files
        assert not any(f"ocdbt.process_{1 - i}/" in rel for rel in files), files
    merged = json.loads((step / integrity.MANIFEST).read_text())["files"]
    assert merged == {**parts[0], **parts[1]} and not set(parts[0]) & set(parts[1])
    for rel, want in merged.items():
        data = (step / rel).read_bytes()
        assert (len(data), zlib.crc32(data)) == (want["bytes"], want["crc32"]), rel

    # Rot a byte (same size) in the biggest file process 1 wrote: process 1 finds it, and
    # process 0, which logs, names it; both fall back to step 1.
    victim = max((step / "state").glob("ocdbt.process_1/**/*"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    rel = victim.relative_to(step).as_posix()
    out0, out1 = _run_pair("resume", tmp_path)
    assert f"is damaged: {rel} does not match its checksum (found by process 1)" in out0, out0
    assert "RESTORED 1 same" in out0 and "RESTORED 1 same" in out1, out0 + out1
    assert (tmp_path / "2.corrupt").is_dir() and not step.exists()


# ------------------------------------ 2 processes: a preemption does not wait for checksums

DELAY_S, CHUNK = 1.0, 16 << 10  # per chunk read: a checkpoint on very slow storage
SLOW_TRAIN = f"""
import sys, time, types, zlib
from titanax.checkpoint import integrity

def slow_crc32(data, crc=0):
    time.sleep({DELAY_S})
    return zlib.crc32(data, crc)

integrity.zlib = types.SimpleNamespace(crc32=slow_crc32)
integrity._CHUNK = {CHUNK}
from launch.train import main
main(sys.argv[1:])
"""


def test_sigusr1_exits_75_on_both_without_waiting_for_checksums(tmp_path):
    work = seed_data(tmp_path)
    port = free_port()
    procs = []
    for i in range(2):
        log = open(work / f"p{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", SLOW_TRAIN, "--workdir", str(work), "--host-devices", "4",
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
             str(i), "--heartbeat-timeout", "30", *SETS, "--set=train.steps=400",
             "--set=checkpoint.every_steps=2"], cwd=ROOT, env=_env(), stdout=log,
            stderr=subprocess.STDOUT))
        procs[-1].log_path = work / f"p{i}.log"
    deadline = time.time() + 240
    # Step 2 is saved and being checksummed (slowly) by both; the save at step 4 waits for it.
    while logged_steps(work) < 3:
        assert all(p.poll() is None for p in procs), procs[0].log_path.read_text()[-3000:]
        assert time.time() < deadline, "the pair never trained"
        time.sleep(0.05)
    t0 = time.time()
    procs[1].send_signal(signal.SIGUSR1)  # one process gets the notice, as in a node's eviction
    codes = wait_all(procs, timeout=120)
    took = time.time() - t0
    log0 = procs[0].log_path.read_text()
    assert codes == [75, 75], log0[-3000:]
    stopped = int(log0.split("saved a checkpoint at step ")[1].split()[0])

    ckpts = work / "checkpoints"
    chunks = 0
    for s in (2, stopped):
        files = integrity.load_manifest(ckpts / str(s))
        assert files and integrity.has_manifest(ckpts / str(s)), s  # both parts, merged
        assert any("ocdbt.process_1/" in r for r in files) and \
            any("ocdbt.process_0/" in r for r in files)
        assert any(f["crc32"] is None for f in files.values()), s  # sizes only: not read back
        chunks += sum(math.ceil(f["bytes"] / CHUNK) for f in files.values())
    # Checksumming both steps, the 2 processes in parallel, would take this long:
    would_take = chunks * DELAY_S / 2
    print(f"both exited {took:.1f} s after the signal; checksums would take {would_take:.0f} s")
    assert took < 30 < would_take / 3, (took, would_take)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
