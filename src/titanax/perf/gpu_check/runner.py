"""The runner: each section (sections.py) in a process of its own, under its time budget.

Why a process per section: a GPU kernel that faults (illegal address, a Mosaic or Triton
abort) poisons the CUDA context or kills the process, and a hung compile cannot be interrupted
from Python; a child process can be killed at its budget and the next section starts on a
clean GPU. The parent never imports jax.

The children stay in the parent's process group and die with it: a loan whose own limit kills
the command's group takes every section down with it, and a parent killed on its own
(SIGKILL) takes its running section too (PR_SET_PDEATHSIG), so no section outlives the run
holding most of the GPU's memory. A section past its budget is killed with its descendants. Each child rewrites sections/NAME.json after every row
(context.py); the parent turns it into the section's entry of gpu_check.json and gpu_check.md,
rewritten after every section, so a run stopped at any point keeps what it had measured.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import functools
import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import traceback

from titanax.perf.gpu_check import pack, report
from titanax.perf.gpu_check.context import SUSPECTS_ENV, SectionContext, error_text
from titanax.perf.gpu_check.sections import DEFAULT_TIME_LIMIT_S, SECTIONS, Section

REPO = pathlib.Path(__file__).resolve().parents[4]
GRACE_S = 10.0  # past its budget a section is killed; before it, it skips what will not fit
KILL_WAIT_S = 5.0  # from SIGTERM to SIGKILL of a section past its grace


# --- the child ------------------------------------------------------------------------------

def run_worker(name: str, fn: str, out_dir: str, *, dry_run: bool, budget_s: float,
               cache_dir: str | None) -> int:
    """Runs one section in this process; its result file is the protocol with the parent."""
    path = pathlib.Path(out_dir) / "sections" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    ctx = SectionContext(name, path, dry_run=dry_run, budget_s=budget_s)
    try:
        if cache_dir:
            import jax

            cache = pathlib.Path(cache_dir).resolve()
            # A rerun after a timeout loads what the first run compiled; compile_s then
            # measures the cache, which the entry count at the start tells.
            ctx.note(compilation_cache=f"{cache} ({len(list(cache.glob('*')))} entries at "
                                       "start)" if cache.is_dir() else f"{cache} (new)")
            jax.config.update("jax_compilation_cache_dir", str(cache))
        module, func = fn.split(":")
        getattr(importlib.import_module(module), func)(ctx)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - recorded; the next section runs
        traceback.print_exc()
        ctx.info["traceback"] = traceback.format_exc()[-2000:]
        ctx.flush("error", error_text(e))
        return 1
    ctx.flush(ctx.final_status())
    return 0


# --- the parent -----------------------------------------------------------------------------

def _child_env(sec: Section, dry_run: bool, suspects: dict) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[SUSPECTS_ENV] = json.dumps(suspects)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    defaults = dict(sec.env)
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"  # the dry run stays off any GPU the machine has
        # The Mosaic GPU interpreter blocks XLA CPU pool threads on mbarriers (conftest.py).
        defaults["PJRT_NPROC"] = "16"
    else:
        # The XLA flags launch.train runs with (cuBLAS GEMMs, FP8 accumulation, collective
        # overlap): the sections measure what training runs.
        from titanax import xla_flags
        env["XLA_FLAGS"] = xla_flags.with_gpu_flags(env.get("XLA_FLAGS", ""), env)
    for k, v in defaults.items():
        env.setdefault(k, v)
    return env


def _pump(stream, log, name: str, tail: collections.deque) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        tail.append(line.rstrip())
        print(f"[{name}] {line}", end="", flush=True)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """preexec_fn of a section: the kernel kills it (SIGKILL) when the runner dies, however
    the runner dies. Linux only; elsewhere the shared process group is all there is."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def descendants(pid: int) -> list[int]:
    """Every process below pid (its children, theirs, ...), read from /proc (Linux; [] where
    there is none): a section's own children (ptxas_report's compile worker) must go down
    with it, and they share the runner's process group, so the group cannot be the unit."""
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen, sig: int) -> None:
    """The section and everything it started (grandchildren first found, then signalled
    together, so none is reparented out of reach in between)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _read_result(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"rows": []}


def _run_child(sec: Section, out: pathlib.Path, budget: float, *, dry_run: bool,
               cache_dir: str | None, suspects: dict) -> dict:
    cmd = [sys.executable, "-m", "launch.gpu_check", "--worker", sec.name, "--worker-fn",
           sec.fn, "--out", str(out), "--budget", f"{budget:.1f}"]
    cmd += ["--dry-run"] if dry_run else []
    cmd += ["--cache-dir", cache_dir] if cache_dir and sec.cache else []
    result_path = out / "sections" / f"{sec.name}.json"
    result_path.unlink(missing_ok=True)
    log_path = out / "logs" / f"{sec.name}.log"
    tail: collections.deque = collections.deque(maxlen=30)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        # In this process group (a loan's limit kills the group: sections too), and dying
        # with this process (_die_with_parent) when it is killed alone.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_child_env(sec, dry_run, suspects),
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, sec.name, tail),
                                daemon=True)
        pump.start()
        timed_out = False
        try:
            proc.wait(timeout=budget + GRACE_S)
        except BaseException as e:  # the time limit, or Ctrl-C / SIGTERM of this runner
            if not isinstance(e, subprocess.TimeoutExpired):
                _kill_tree(proc, signal.SIGKILL)  # never leave a child holding the GPU
                proc.wait()
                raise
            timed_out = True
            _kill_tree(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                _kill_tree(proc, signal.SIGKILL)
                proc.wait()
        pump.join(timeout=5)
    res = _read_result(result_path)
    res.update(seconds=round(time.monotonic() - t0, 2), budget_s=round(budget, 1),
               log=str(log_path), returncode=proc.returncode)
    if timed_out:
        res.update(status="timeout", error=f"killed at the section's time limit "
                                           f"({budget + GRACE_S:.0f} s); rows so far are kept")
    elif res.get("status") in (None, "running"):
        res.update(status="error", error=f"worker exited with code {proc.returncode} before "
                                         "finishing; last output: " + " / ".join(list(tail)[-5:]))
    return res


def suspects_after(name: str, res: dict) -> dict:
    """The kernels (context.attention_key, fp8_key) a finished section shows to be unsafe to
    run again: those of a row that failed or raised, and those of the row it was in when it
    hung or died."""
    found = {}
    for row in res.get("rows", []):
        if row.get("status") in ("error", "fail"):
            why = f"{row['status']} in section {name}"
            if row.get("error"):
                why += f" ({str(row['error'])[:100]})"
            for u in row.get("uses", []):
                found.setdefault(u, why)
    current = res.get("current") or {}
    if res.get("status") in ("timeout", "error", "interrupted"):
        for u in current.get("uses", []):
            found[u] = f"{res['status']} in section {name} while it ran"
    return found


def run(names, out_dir, *, dry_run: bool, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
        cache_dir: str | None = None, command: str = "", sections=SECTIONS,
        pack_dir: str | None = None) -> dict:
    """Runs the named sections in the order given. pack_dir: after every section, also
    gpu_check.json, gpu_check.md and logs.tar.gz (every log and section file) there: three
    files, for a machine that returns only a few (scripts/gpu_loan.sh)."""
    out = pathlib.Path(out_dir).resolve()
    for sub in ("sections", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    by_name = {s.name: s for s in sections}
    chosen = [by_name[n] for n in names if n in by_name]
    rep = {"command": command, "dry_run": dry_run, "time_limit_s": time_limit_s,
           "started": datetime.datetime.now().isoformat(timespec="seconds"), "out": str(out),
           "cache_dir": cache_dir, "elapsed_s": 0.0, "suspects": {},
           "sections": {s.name: {"status": "pending", "what": s.what} for s in chosen}}
    write = functools.partial(_write, pack_dir=pathlib.Path(pack_dir) if pack_dir else None)
    write(out, rep)
    # A SIGTERM (a scheduler's or a tool's time limit) unwinds like Ctrl-C, so the running
    # section's process group is killed on the way out (its own session does not get it).
    main = threading.current_thread() is threading.main_thread()  # where handlers may be set
    previous = signal.signal(signal.SIGTERM, _raise_exit) if main else None
    try:
        _run_sections(chosen, rep, out, dry_run=dry_run, time_limit_s=time_limit_s,
                      cache_dir=cache_dir, write=write)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return rep


def _write(out: pathlib.Path, rep: dict, *, pack_dir: pathlib.Path | None) -> None:
    report.write(out, rep)
    if pack_dir is not None:
        pack.pack(out, pack_dir)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _run_sections(chosen, rep: dict, out: pathlib.Path, *, dry_run: bool, time_limit_s: float,
                  cache_dir: str | None, write) -> None:
    scale = time_limit_s / DEFAULT_TIME_LIMIT_S
    t0 = time.monotonic()
    for sec in chosen:
        # A section killed at its limit (budget + grace, then the SIGKILL wait) still ends
        # inside the run's time limit: that limit is the run's worst case.
        room = time_limit_s - (time.monotonic() - t0) - GRACE_S - KILL_WAIT_S
        budget = min((sec.dry_budget_s if dry_run else sec.budget_s) * scale, room)
        if room < 5:
            res = {"status": "skipped", "reason": f"the run's time limit ({time_limit_s:.0f} s) "
                                                  "was spent", "rows": []}
        else:
            print(f"== {sec.name}: budget {budget:.0f} s", flush=True)
            try:
                res = _run_child(sec, out, budget, dry_run=dry_run, cache_dir=cache_dir,
                                 suspects=rep["suspects"])
            except BaseException:  # Ctrl-C or SIGTERM: keep what the section had written
                res = _read_result(out / "sections" / f"{sec.name}.json")
                res.update(status="interrupted", error="the run was stopped (Ctrl-C/SIGTERM)")
                rep["sections"][sec.name] = {"what": sec.what, **res}
                write(out, rep)
                raise
        if res["status"] == "skipped" and not res.get("reason"):
            res["reason"] = res.get("info", {}).get("reason", "")
        rep["sections"][sec.name] = {"what": sec.what, **res}
        for key, why in suspects_after(sec.name, res).items():
            rep["suspects"].setdefault(key, why)
        rep["elapsed_s"] = round(time.monotonic() - t0, 1)
        write(out, rep)
        print(f"== {sec.name}: {res['status']} in {res.get('seconds', 0):.0f} s", flush=True)
