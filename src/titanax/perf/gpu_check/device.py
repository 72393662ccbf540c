"""Sections 1 and 2: what the machine is (versions, GPU, memory, driver), and the ptxas reports
of our kernels compiled for it (registers, spills, shared memory: titanax.perf.ptxas_report)."""

from __future__ import annotations

import platform
import socket

import jax

from pallas_kernels.flash_attention.backends import GPU_FALLBACK, generation_kernels
from pallas_kernels.target import compute_capability
from titanax.hardware import HARDWARE, lookup_device
from titanax.perf.gpu_check.preflight import (
    cuda_versions,
    nvidia_smi,
    package_version,
    version_problems,
)

# ptxas_report targets: GB200 carries the B200's chip (compute capability 10.0, sm_100a code).
_PTXAS_KIND = {"h100": "h100", "h200": "h200", "b200": "b200", "gb200": "b200"}


def gpu_key(device_kind: str) -> str | None:
    """'h100', 'h200', 'b200' or 'gb200' (hardware.py's keys) for a jax device_kind."""
    hw = lookup_device(device_kind)
    return next((k for k, v in HARDWARE.items() if v is hw), None) if hw else None


def our_attention_impl() -> str:
    """The flash attention kernel written for this GPU: named explicitly, never 'auto' (whose
    choice may change), so the numbers say which kernel they are."""
    major = (compute_capability() or (0, 0))[0]
    ours = generation_kernels(major)
    return ours[0].name if ours else GPU_FALLBACK


def device_section(ctx) -> None:
    dev = jax.devices()[0]
    key = gpu_key(dev.device_kind)
    hw = HARDWARE.get(key) if key else None
    stats = dev.memory_stats() or {}
    cc = compute_capability()
    ctx.note(
        python=platform.python_version(), host=socket.gethostname(), jax=jax.__version__,
        jaxlib=package_version("jaxlib"),
        cuda_plugin=package_version("jax-cuda13-plugin") or package_version("jax-cuda12-plugin"),
        flax=package_version("flax"), platform=dev.platform,
        platform_version=getattr(dev.client, "platform_version", None),
        device_kind=dev.device_kind, device_count=jax.device_count(), gpu=key,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        memory_bytes_limit=stats.get("bytes_limit"),
        memory_datasheet_bytes=hw.hbm_bytes if hw else None,
        peak_bf16_flops=hw.bf16_flops if hw else None,
        peak_fp8_flops=hw.fp8_flops if hw else None,
        attention_kernel=our_attention_impl() if dev.platform == "gpu" else None,
        **cuda_versions(), **(nvidia_smi() if dev.platform == "gpu" else {}))
    # The pins the loan's numbers are for: a package off its pin is a warning row (the
    # preflight already refused a jax other than the pinned one).
    for row in version_problems()[1]:
        ctx.add(row)


def ptxas_section(ctx) -> None:
    if ctx.dry_run:
        ctx.note(skipped=True, reason="needs the CUDA plugin/GPU: the reports come from "
                                      "compiling the kernels for this GPU (dry run)")
        return
    kind = _PTXAS_KIND.get(gpu_key(jax.devices()[0].device_kind) or "")
    if kind is None:
        ctx.note(skipped=True, reason=f"no ptxas target for {jax.devices()[0].device_kind!r}")
        return
    try:
        from titanax.perf import ptxas_report
    except ModuleNotFoundError as e:
        if e.name != "titanax.perf.ptxas_report":
            raise
        ctx.note(skipped=True, reason="titanax.perf.ptxas_report is not in this checkout")
        return
    rows = ptxas_report.collect(kind, on_device=True)
    for row in rows:  # each row carries ptxas_report's verdict: "ok" and "why"
        ctx.add({**row, "status": "ok" if row.get("ok", True) else "fail"})
    problems = ptxas_report.check(rows)
    ctx.markdown = ptxas_report.markdown_table(rows)
    ctx.note(kind=kind, problems=problems)
