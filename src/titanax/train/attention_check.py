"""First contact: before the first step, the attention kernel `auto` picks is checked on this
GPU when no GPU run has recorded it there (docs/attention.md, "First contact").

`execution.attention_impl=auto` runs one of our Pallas kernels on a GPU (packed documents,
shard_map bodies: pallas_kernels/flash_attention/resolve.py). When pallas_kernels/measured.py
holds no record of that kernel on this GPU generation (VERIFIED, or WINS, whose benchmark ran
it), the run checks it before its first step: values and gradients of a small case with the
run's head dim, GQA ratio, document layout and dtype against the XLA reference
(pallas_kernels/flash_attention/check.py), at the kernel's default config, the one the run
uses. The check runs in a child process, so a kernel that crashes (a fault, an abort) or hangs
does not take the run down; it takes seconds (compiles, then one small case).

A kernel that fails is refused for this process (resolve.refuse): `auto` then runs cuDNN (with
packed documents as a dense mask, whose cost backend_cudnn warns of once) or, where cuDNN
cannot go (shard_map bodies, float32), the XLA reference; one log line names the kernel, the
error and the replacement. A pass says nothing.

The verdict, pass or fail, is cached per (jax version, GPU name, kernel, its default config,
head dim, GQA ratio, documents, dtype) in `<train.compilation_cache>/attention_check/`, so a
resumed or repeated run does not check again (delete that folder to check again). With
train.compilation_cache="" there is no cache and every run checks. In a multi-process run
process 0 decides and tells the others, so every process compiles the same program.
`execution.attention_check=false` skips all of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np

import pallas_kernels
import titanax
from pallas_kernels import measured
from pallas_kernels.flash_attention import resolve
from pallas_kernels.flash_attention.backends import backend
from pallas_kernels.flash_attention.config import default_config
from pallas_kernels.target import compute_capability, target_platform

logger = logging.getLogger(__name__)

CHILD_TIMEOUT_S = 120  # a hang is a failure too; the check itself takes seconds
CACHE_FOLDER = "attention_check"
VERDICT_PREFIX = "titanax-attention-check: "  # the child's one line of result on stdout
# The case on a GPU: S off the block grid (padding and key tails), 2 kv heads.
GPU_CASE = dict(B=2, S=1000, Hkv=2)
# On a CPU (tests) the kernel runs in interpret mode (~9 ms a grid step): one kv head, S 200.
CPU_CASE = dict(B=1, S=200, Hkv=1)
_CHILD = "from titanax.train.attention_check import child_main; child_main()"


def _in_shard_map(mesh) -> bool:
    """The run's attention is traced inside jax.shard_map: pipeline stages, context blocks."""
    shape = dict(mesh.shape)
    return shape.get("pipeline", 1) > 1 or shape.get("context", 1) > 1


def planned_kernel(cfg, mesh) -> str | None:
    """The kernel of ours `auto` will run in this run's attention when measured.py holds no
    record of it on this GPU generation, else None (an explicit impl, the check off, off a GPU,
    cuDNN or the reference, or a kernel a GPU run checked)."""
    ex = cfg.execution
    if ex.attention_impl != "auto" or not ex.attention_check:
        return None
    with jax.set_mesh(mesh):
        if target_platform() != "gpu":
            return None
        cc = compute_capability() or (0, 0)
        impl = resolve.resolve_impl("auto", ex.dtype, cfg.model.resolved_head_dim,
                                    segment_ids=cfg.data.masks_documents,
                                    manual=_in_shard_map(mesh), seq_len=cfg.train.seq_len,
                                    plan=True)
    if not backend(impl).is_kernel or measured.verified(impl, cc):
        return None
    return impl


def check_case(cfg, impl: str) -> dict:
    """What the child checks: the run's head dim, GQA ratio, document layout and dtype."""
    m = cfg.model
    return {"impl": impl, "head_dim": m.resolved_head_dim, "gqa": m.n_heads // m.n_kv_heads,
            "segments": cfg.data.masks_documents, "dtype": cfg.execution.dtype}


def describe_case(case: dict) -> str:
    return (f"{case['impl']} (head_dim {case['head_dim']}, GQA {case['gqa']}, "
            f"{'documents' if case['segments'] else 'no documents'})")


def cache_key(case: dict, device_kind: str) -> str:
    """One verdict per jax version, GPU, kernel and its default config, and case."""
    config = repr(default_config(case["impl"], case["head_dim"]))
    fields = [jax.__version__, device_kind, case["impl"], config, case["head_dim"],
              case["gqa"], case["segments"], case["dtype"]]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:24]


def _read_cached(path: pathlib.Path | None) -> dict | None:
    if path is None:
        return None
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: check again
        return None
    return verdict if isinstance(verdict, dict) and "pass" in verdict else None


def _write_cached(path: pathlib.Path | None, verdict: dict) -> None:
    """Whole or not at all (a reader never sees half a verdict); a cache that cannot be
    written only means the next run checks again."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdict, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("attention check: cannot cache the verdict in %s (%s); the next run "
                       "checks again", path, e)


def _child_env() -> dict:
    """The parent's environment, with titanax and pallas_kernels importable from a checkout
    (src/ and the repository root) and no preallocation: the parent holds most of the GPU's
    memory already."""
    env = dict(os.environ)
    roots = [str(pathlib.Path(m.__file__).resolve().parent.parent)
             for m in (titanax, pallas_kernels)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        [*roots, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]))
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def _crash_text(rc: int, stderr: str) -> str:
    how = (f"signal {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals()
           else f"exit code {rc}")
    tail = [line.strip() for line in stderr.splitlines() if line.strip()][-3:]
    return f"crashed ({how}): " + (" / ".join(tail)[-400:] if tail else "no output")


def run_child(case: dict, device=None, timeout_s: float = CHILD_TIMEOUT_S) -> dict:
    """Runs the check in a child process: its verdict ({"pass", "error", "seconds", ...});
    a crash, a hang or no verdict is a failure whose error says so. device: the parent's GPU,
    the one the child uses."""
    t0 = time.perf_counter()
    gpu = getattr(device, "platform", None) == "gpu"
    payload = dict(case, device=device.local_hardware_id if gpu else None)
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(payload),
                              capture_output=True, text=True, timeout=timeout_s,
                              env=_child_env())
    except subprocess.TimeoutExpired:
        return {"pass": False, "error": f"hung: no verdict after {timeout_s:.0f} s",
                "seconds": round(time.perf_counter() - t0, 1)}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(VERDICT_PREFIX)]
    if proc.returncode or not lines:
        verdict = {"pass": False, "error": _crash_text(proc.returncode, proc.stderr)}
    else:
        verdict = json.loads(lines[-1][len(VERDICT_PREFIX):])
    return {**verdict, "seconds": round(time.perf_counter() - t0, 1)}


def _error_of(result: dict) -> str:
    """The worst tensor's error, e.g. 'dq rel error 0.64 > 0.02'."""
    name, rel = max(((n, result[f"{n}_rel"]) for n in ("out", "dq", "dk", "dv")),
                    key=lambda item: item[1])
    if not np.isfinite(rel):
        return f"{name} is not finite"
    return f"{name} rel error {rel:.2g} > {result['tol']:g}"


def child_main() -> None:
    """The child process: reads the case (JSON) from stdin, checks it, prints one verdict
    line. A GPU child runs the run's case at its default config; a CPU one (tests) a smaller
    one in interpret mode."""
    case = json.loads(sys.stdin.read())
    if case.get("device") is not None:  # the parent's GPU alone
        jax.config.update("jax_cuda_visible_devices", str(case["device"]))
    from pallas_kernels.flash_attention.check import check_against_reference

    t0 = time.perf_counter()
    cpu = jax.devices()[0].platform == "cpu"
    shape = CPU_CASE if cpu else GPU_CASE
    impl, D = case["impl"], case["head_dim"]
    result = check_against_reference(
        impl, B=shape["B"], S=shape["S"], Hkv=shape["Hkv"], Hq=shape["Hkv"] * case["gqa"], D=D,
        dtype=case["dtype"], segments=case["segments"], interpret=cpu,
        config=default_config(impl, D, interpret=cpu))
    verdict = {"pass": bool(result["pass"]),
               "errors": {n: result[f"{n}_rel"] for n in ("out", "dq", "dk", "dv")},
               "tol": result["tol"], "shape": shape, "check_s": round(time.perf_counter() - t0, 1)}
    if not verdict["pass"]:
        verdict["error"] = _error_of(result)
    print(VERDICT_PREFIX + json.dumps(verdict), flush=True)


def _verdict(cfg, impl: str, device, cache_dir) -> tuple[dict, dict]:
    """(case, verdict): the cached one, else the child's, cached."""
    case = check_case(cfg, impl)
    kind = getattr(device, "device_kind", "unknown")
    path = (pathlib.Path(cache_dir) / CACHE_FOLDER / f"{cache_key(case, kind)}.json"
            if cache_dir else None)
    cached = _read_cached(path)
    if cached is not None:
        return case, cached
    verdict = {**run_child(case, device), "case": case, "device_kind": kind,
               "jax": jax.__version__}
    _write_cached(path, verdict)
    return case, verdict


def _agreed(passed: bool) -> bool:
    """Process 0's verdict on every process, so all compile the same program."""
    if jax.process_count() == 1:
        return passed
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.array(int(passed), np.int32)))


def first_contact(cfg, mesh, cache_dir, log=print) -> None:
    """The check before the first step (module docstring). cache_dir: the compilation cache
    folder (None or "": no cache). On a failure the kernel is refused for this process and
    `log` gets one line; a pass logs nothing."""
    impl = planned_kernel(cfg, mesh)
    if impl is None:
        return
    device = mesh.devices.flat[0]
    case, verdict = (_verdict(cfg, impl, device, cache_dir) if jax.process_index() == 0
                     else (check_case(cfg, impl), {"pass": True}))
    if _agreed(bool(verdict.get("pass"))):
        logger.debug("attention check: %s passed (%s)", describe_case(case), verdict)
        return
    error = verdict.get("error") or "failed on process 0"
    resolve.refuse(impl, error)
    with jax.set_mesh(mesh):
        instead = resolve.resolve_impl("auto", cfg.execution.dtype, case["head_dim"],
                                       segment_ids=case["segments"],
                                       manual=_in_shard_map(mesh), seq_len=cfg.train.seq_len)
    log(f"attention check: {describe_case(case)} failed on "
        f"{verdict.get('device_kind') or getattr(device, 'device_kind', 'this GPU')}: "
        f"{error}; this run uses {instead} instead (execution.attention_check=false skips the "
        "check)")
