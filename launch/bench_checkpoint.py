"""python -m launch.bench checkpoint [--gb 3] [--processes 1|2] [--dir DIR] [--warm] [--json OUT]

Times a checkpoint of --gb GB of float32 arrays (a train state: parameters and two Adam moments,
sharded over all devices) saved by --processes local processes (jax.distributed over
127.0.0.1, one CPU device each, as a multi-host run on a shared filesystem):

  save      the step loop's wait: until the arrays are copied off the devices
  commit    until orbax has written and committed the step
  manifest  after the commit, until the slowest process has written its manifest part
            (checkpoint/integrity.py: each process checksums its share, in the background)
  verify    the check before a resume, every process its share in parallel (slowest)
  resume    Checkpointer.restore_latest_good: verify, agree, restore (slowest process)
  1 reader  verify as before this change: process 0 alone reads the whole step, one thread

Before verify, resume and 1 reader the step's files are flushed and dropped from the page cache
(posix_fadvise), so those read the disk, as a resume on another node does; --warm keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ARRAYS = ("params", "mu", "nu")
COLS = 4096  # floats per row: 16 KB rows, sharded by rows over the devices


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drop_cache(step_dir: pathlib.Path) -> None:
    """Flushes and evicts the step's files from the page cache: later reads hit the disk."""
    for p in step_dir.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _start_jax(args) -> None:
    """One CPU device per process; several processes join over 127.0.0.1."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 1)
    if args.processes > 1:
        from titanax import distributed

        distributed.initialize(distributed.ProcessSpec(
            f"127.0.0.1:{args.port}", args.processes, args.worker, None, "launch.bench"))


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _make_state(gb: float):
    """(state, shape, sharding): ARRAYS of float32 [rows, COLS], --gb in all, sharded by rows
    over every device."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))
    rows = int(gb * 1e9 / len(ARRAYS) / COLS / 4) // len(jax.devices()) * len(jax.devices())
    shape = (rows, COLS)
    make = jax.jit(lambda k: jax.random.normal(k, shape, np.float32), out_shardings=sharding)
    state = {name: make(jax.random.key(i)) for i, name in enumerate(ARRAYS)}
    jax.block_until_ready(state)
    return state, shape, sharding


def _time_save(state: dict, folder: pathlib.Path, cfg, out: dict) -> None:
    """Saves step 1 and records save_s, commit_s, manifest_s, step_bytes and share_bytes in
    out."""
    import jax

    from titanax.checkpoint import integrity
    from titanax.checkpoint.manager import Checkpointer

    ckpt = Checkpointer(folder, cfg)
    _barrier("bench: start")
    t0 = time.perf_counter()
    ckpt.save(1, state, data_state=None, config={})
    out["save_s"] = time.perf_counter() - t0
    ckpt.manager.wait_until_finished()
    out["commit_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    ckpt.wait()  # this process's manifest part
    out["manifest_s"] = time.perf_counter() - t1
    ckpt.close()
    _barrier("bench: sealed")
    step_dir = folder / "1"
    assert integrity.has_manifest(step_dir), "the parts were not merged"
    out["step_bytes"] = sum(f["bytes"] for f in integrity.load_manifest(step_dir).values())
    part_file = integrity.part_name(jax.process_index(), jax.process_count())
    part = json.loads((step_dir / part_file).read_text())["files"]
    out["share_bytes"] = sum(f["bytes"] for f in part.values())  # what this process read


def _time_reads(args, folder: pathlib.Path, cfg, shape, sharding, out: dict) -> None:
    """Records verify_s, resume_s and (process 0) one_reader_s in out, each from a cold page
    cache unless --warm."""
    import jax
    import numpy as np

    from titanax.checkpoint import integrity
    from titanax.checkpoint.manager import Checkpointer

    index, count = jax.process_index(), jax.process_count()
    step_dir = folder / "1"

    def cold():
        if not args.warm and index == 0:
            _drop_cache(step_dir)
        _barrier("bench: cold")

    cold()
    t0 = time.perf_counter()
    damage = integrity.find_damage(step_dir, index, count)
    out["verify_s"] = time.perf_counter() - t0
    assert damage is None, damage
    _barrier("bench: verified")

    cold()
    abstract = {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
                for name in ARRAYS}
    t0 = time.perf_counter()
    got = Checkpointer(folder, cfg, read_only=True).restore_latest_good(abstract,
                                                                         log=lambda _m: None)
    jax.block_until_ready(got.state)
    out["resume_s"] = time.perf_counter() - t0
    for x in got.state.values():
        x.delete()
    _barrier("bench: resumed")

    cold()
    if index == 0:
        t0 = time.perf_counter()
        assert integrity.find_damage(step_dir, 0, 1, threads=1) is None
        out["one_reader_s"] = time.perf_counter() - t0
    _barrier("bench: done")


def _worker(args) -> None:
    _start_jax(args)
    import jax

    from titanax.config import CheckpointConfig

    state, shape, sharding = _make_state(args.gb)
    folder, cfg = pathlib.Path(args.dir), CheckpointConfig(keep=1)
    out = {"bytes": sum(x.nbytes for x in state.values()), "processes": jax.process_count()}
    _time_save(state, folder, cfg, out)
    for x in state.values():
        x.delete()
    _time_reads(args, folder, cfg, shape, sharding, out)
    pathlib.Path(args.out).write_text(json.dumps(out))


def _table(rows: list[dict]) -> str:
    head = ("| processes | step (GB) | largest share (GB) | save (s) | commit (s) | manifest (s) "
            "| verify (s) | resume (s) | 1 reader (s) |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['processes']} | {r['step_bytes'] / 1e9:.2f} "
                     f"| {r['share_bytes'] / 1e9:.2f} | {r['save_s']:.2f} "
                     f"| {r['commit_s']:.2f} | {r['manifest_s']:.2f} | {r['verify_s']:.2f} "
                     f"| {r['resume_s']:.2f} | {r['one_reader_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.bench checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=3.0, help="float32 state to save, in GB")
    p.add_argument("--processes", type=int, default=1, help="local processes sharing the save")
    p.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one, "
                   "deleted after); must not hold checkpoints")
    p.add_argument("--warm", action="store_true", help="keep the step in the page cache")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        _worker(args)
        return
    if args.gb <= 0 or args.processes < 1:
        p.error("--gb must be > 0 and --processes >= 1")

    own = args.dir is None
    folder = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="titanax_bench_ckpt_"))
    if folder.exists() and any(folder.iterdir()):
        p.error(f"--dir {folder} is not empty: give an empty or new folder")
    port = _free_port()
    results = pathlib.Path(tempfile.mkdtemp(prefix="titanax_bench_ckpt_out_"))
    try:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "launch.bench_checkpoint", "--gb", str(args.gb),
             "--processes", str(args.processes), "--dir", str(folder), "--worker", str(i),
             "--port", str(port), "--out", str(results / f"{i}.json")]
            + (["--warm"] if args.warm else [])) for i in range(args.processes)]
        codes = [proc.wait() for proc in procs]
        if any(codes):
            print(f"error: a benchmark process failed (exit codes {codes}); see above",
                  file=sys.stderr)
            raise SystemExit(1)
        per = [json.loads((results / f"{i}.json").read_text()) for i in range(args.processes)]
    finally:
        shutil.rmtree(results, ignore_errors=True)
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    # The slowest process is what a run waits for.
    row = {k: max(r.get(k, 0.0) for r in per) for k in per[0] if k.endswith("_s")}
    row.update(processes=args.processes, step_bytes=per[0]["step_bytes"],
               share_bytes=max(r["share_bytes"] for r in per),
               one_reader_s=per[0]["one_reader_s"], per_process=per)
    print(_table([row]))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(row, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
