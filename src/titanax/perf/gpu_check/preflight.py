"""The first seconds of a GPU loan (scripts/gpu_loan.sh -> launch.gpu_check --preflight): before
any section runs, the packages import (smoke.py), jax is the version titanax pins, and jax has
a GPU. A loan on which the CUDA plugin fails to start would otherwise fall back to the CPU
without a word, build the 70B-shaped step in host memory and spend the whole loan there.

Refusals are one `error:` line and a gpu_check.json / gpu_check.md in the loan's $OUT saying
why (exit 3), so the loan returns the reason; no section runs. flax, optax and orbax outside
their pins (constraints.txt) are warnings, kept in the report's `preflight` entry.

Nothing at module level imports jax (the device section imports these helpers too), and the
GPU probe starts the backend in a thread it can give up on (a hung driver must not hang the
loan).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import pathlib
import subprocess
import threading
import time

from titanax.perf.gpu_check import pack, report
from titanax.perf.gpu_check.sections import DEFAULT_ORDER

REPO = pathlib.Path(__file__).resolve().parents[4]
JAX_PIN = "0.11.2"  # constraints.txt; the GPU image carries exactly this one
WARN_PINS = ("flax", "optax", "orbax-checkpoint")  # differing: a warning row, not a refusal
PROBE_TIMEOUT_S = 30.0
EXIT_NO_GPU = 3


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pins(path: pathlib.Path = REPO / "constraints.txt") -> dict[str, str]:
    """{package: version} of constraints.txt's `name==version` lines (names lower-case,
    '_' as '-')."""
    out = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def version_problems(versions: dict[str, str | None] | None = None,
                     pinned: dict[str, str] | None = None) -> tuple[str | None, list[dict]]:
    """(the refusal for a jax/jaxlib other than the pin, or None; one row per pinned package:
    package, version, pinned, status 'ok' or 'warning')."""
    pinned = pins() if pinned is None else pinned
    versions = versions if versions is not None else {
        n: package_version(n) for n in ("jax", "jaxlib", *WARN_PINS)}
    wrong = [f"{n} {versions.get(n)}" for n in ("jax", "jaxlib") if versions.get(n) != JAX_PIN]
    error = (f"{' and '.join(wrong)} found, titanax pins {JAX_PIN} (constraints.txt; the "
             "kernels and the loan's numbers are for that version): run on an image with jax "
             f"and jaxlib {JAX_PIN}") if wrong else None
    rows = []
    for name in ("jax", "jaxlib", *WARN_PINS):
        want, have = pinned.get(name, JAX_PIN if name in ("jax", "jaxlib") else None), \
            versions.get(name)
        row = {"package": name, "version": have, "pinned": want, "status": "ok"}
        if want and have != want:
            row["status"] = "error" if name in ("jax", "jaxlib") else "warning"
            row["reason"] = (f"{name} {have} is not the pinned {want}: the results may differ "
                             "from CI's; carry the pinned wheel (docs/gpu_check.md, 'What to "
                             "carry')" if row["status"] == "warning" else error)
        rows.append(row)
    return error, rows


def nvidia_smi() -> dict:
    """The GPU as nvidia-smi sees it (smi_name, smi_driver_version, ...), or why it cannot say
    ({"nvidia_smi": ...})."""
    fields = "name,driver_version,memory.total,clocks.max.sm,power.limit,temperature.gpu"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"nvidia_smi": f"not available ({type(e).__name__})"}
    if r.returncode:
        return {"nvidia_smi": f"exit {r.returncode}: {r.stderr.strip()[:200]}"}
    first = r.stdout.strip().splitlines()[0].split(", ")
    return {f"smi_{k.replace('.', '_')}": v for k, v in zip(fields.split(","), first)}


def cuda_versions() -> dict:
    """The CUDA runtime, cuDNN, driver and cuBLAS versions jaxlib reports ({} in a jaxlib
    without CUDA; None for a library it cannot load)."""
    try:
        from jax._src.lib import cuda_versions as versions  # None in a CPU-only jaxlib
    except ImportError:
        return {}
    out = {}
    for name in ("cuda_runtime_get_version", "cudnn_get_version", "cuda_driver_get_version",
                 "cublas_get_version"):
        fn = getattr(versions, name, None)
        try:
            out[name.removesuffix("_get_version")] = fn() if fn else None
        except Exception:  # noqa: BLE001 - a missing library is worth a None, not a failure
            out[name.removesuffix("_get_version")] = None
    return out


def cuda_facts() -> dict:
    """What the machine offers a CUDA backend, for the refusal line: jax's CUDA plugin
    distributions and versions, the CUDA versions jaxlib reports, the GPU nvidia-smi sees."""
    plugins = sorted(f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
                     if "jax-cuda" in (d.metadata["Name"] or "").lower())
    return {"cuda_plugins": plugins or ["none"], **cuda_versions(), **nvidia_smi()}


def _start_backend(result: dict) -> None:
    try:
        import jax

        devs = jax.devices()
        result.update(platform=devs[0].platform, device_kind=devs[0].device_kind,
                      device_count=len(devs))
    except BaseException as e:  # noqa: BLE001 - reported in the refusal
        result["error"] = f"{type(e).__name__}: {str(e).strip()[:400]}" if str(e).strip() else (
            f"{type(e).__name__} with no message from jax.devices() (jax found no backend for "
            "JAX_PLATFORMS; no CUDA plugin registered?)")


def probe_gpu(timeout_s: float = PROBE_TIMEOUT_S) -> tuple[dict, str | None]:
    """Starts jax's backend (JAX_PLATFORMS as the caller set it: the loan sets cuda) and checks
    that its first device is a GPU. (facts, the refusal or None); facts include the seconds
    it took."""
    result: dict = {}
    t0 = time.monotonic()
    thread = threading.Thread(target=_start_backend, args=(result,), daemon=True)
    thread.start()
    thread.join(timeout_s)
    result["backend_start_s"] = round(time.monotonic() - t0, 1)
    if thread.is_alive():
        result["error"] = f"jax's backend did not start within {timeout_s:.0f} s"
    facts = {**result, **cuda_facts()}
    if "error" not in result and result.get("platform") == "gpu":
        return facts, None
    said = result.get("error") or (f"jax started platform {result.get('platform')!r} "
                                   f"({result.get('device_kind')}), not a GPU")
    import os
    return facts, (f"no GPU: {said}; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS') or '(unset)'}"
                   f", jax {package_version('jax')}, CUDA plugins: {', '.join(facts['cuda_plugins'])}"
                   f", CUDA runtime {facts.get('cuda_runtime')}, driver "
                   f"{facts.get('cuda_driver')}, nvidia-smi: "
                   f"{facts.get('nvidia_smi') or facts.get('smi_name')}")


def write_refusal(error: str, facts: dict, *, out_dir: pathlib.Path,
                  pack_dir: pathlib.Path | None, command: str) -> None:
    """gpu_check.json / .md saying why nothing ran (and, with pack_dir, the loan's copies)."""
    rep = {"command": command, "dry_run": False, "time_limit_s": 0.0, "elapsed_s": 0.0,
           "started": datetime.datetime.now().isoformat(timespec="seconds"),
           "out": str(out_dir), "error": error, "preflight": facts, "suspects": {},
           "sections": {n: {"status": "skipped", "reason": "preflight refused the run: "
                                                           + error[:200], "rows": []}
                        for n in DEFAULT_ORDER}}
    for sub in ("sections", "logs"):
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
    report.write(out_dir, rep)
    if pack_dir is not None:
        pack.pack(out_dir, pack_dir)


def preflight(*, dry_run: bool, out_dir: pathlib.Path, pack_dir: pathlib.Path | None,
              command: str) -> tuple[int, str | None, dict]:
    """(exit code: 0, 2 for a package that does not import, 3 for no GPU or the wrong jax;
    the error line or None; the facts for the report). Writes the refusal's report."""
    from titanax.perf.gpu_check import smoke

    problem = smoke.check()
    if problem:  # nothing else can be trusted; smoke's line names the package to carry
        return 2, problem, {}
    error, rows = version_problems()
    facts: dict = {"versions": rows}
    if error is None and not dry_run:
        gpu, error = probe_gpu()
        facts.update(gpu)
    if error:
        write_refusal(error, facts, out_dir=out_dir, pack_dir=pack_dir, command=command)
        return EXIT_NO_GPU, error, facts
    return 0, None, facts
