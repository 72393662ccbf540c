"""The compiling half of titanax.perf.ptxas_report, run as a subprocess per GPU kind:

    python -m titanax.perf.ptxas_worker KIND OUT.json [--on-device] [--sass] [--only=RE] HEAD_DIM...

Compiles every kernel case (flash attention fwd/dq/dkv per impl, head_dim and masking; the
FP8 matmuls) as its own jit and writes one JSON record per kernel entry to OUT.json. The
parent sets the environment: MOSAIC_GPU_DUMP_PTX/PTXAS/RESOURCES (Mosaic prints the PTX, the
`ptxas -v` report and its Resources to stdout for every kernel it compiles) and XLA_FLAGS
dumping each module's thunk sequence and PTX to $TITANAX_PTXAS_XLA_DUMP (where the Triton
kernels end up). Needs the CUDA plugin (deviceless: JAX_PLATFORMS=cpu) or a GPU (--on-device).

Mosaic's stdout dumps name no kernel, and XLA compiles a module's kernels in an order of its
own (the sm90 backward's dkv kernel before dq), so each case is a jit holding at most one
Mosaic kernel: the backward is compiled twice, keeping dq, then dk and dv (jit drops the
kernel whose outputs are unused). Each case's stdout goes to its own file (file descriptor 1
redirected: the dumps come from C++ as well as Python).

--sass adds each kernel's SASS audit (titanax.perf.sass_audit) to its record: Mosaic prints the
SASS with MOSAIC_GPU_DUMP_SASS=1 (set by the parent) into the same stdout; Triton kernels' PTX
is assembled to a cubin with the same ptxas and disassembled with nvdisasm. --only=RE keeps the
cases whose "impl pass head_dim variant" label RE matches (re.search): the tests compile two.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from pallas_kernels.flash_attention.backends import GPU_FALLBACK, generation_kernels
from pallas_kernels.flash_attention.kernel_sm90 import PERSISTENT_OVERLAP_MAX_HEAD_DIM
from pallas_kernels.flash_attention.kernel_sm90_bwd import FUSED_MAX_HEAD_DIM
from pallas_kernels.flash_attention.kernel_sm100_bwd import MAX_HEAD_DIM as SM100_MAX_HEAD_DIM
from pallas_kernels.fp8.backends import MATMULS
from titanax.perf import ptxas_report as rep
from titanax.perf import sass_audit

# Small but real: GQA 8 q heads on 1 kv head. Sizes enter the kernels as loop bounds and grid
# dimensions only, so registers and shared memory are those of the 70B shapes.
B, SEQ, HQ, HKV = 1, 2048, 8, 1
FP8_MNK = (1024, 1024, 1024)
# Per target: the kernels the backend tables list for its GPU generation (plus the portable
# attention kernel; the FP8 grid kernel is no GPU kernel: fp8_matmul refuses it on GPU).
ARCH_CC = {"sm_90a": 9, "sm_100a": 10}
ATTENTION_IMPLS = {arch: (*(b.name for b in generation_kernels(cc)), GPU_FALLBACK)
                   for arch, cc in ARCH_CC.items()}
FP8_IMPLS = {arch: tuple((m.name, s) for m in MATMULS.values() if m.compute_capability == cc
                         for s in m.scalings) for arch, cc in ARCH_CC.items()}


@contextlib.contextmanager
def _stdout_to(path: str):
    """Points file descriptor 1 at `path`: Mosaic's C++ dumps write there, not to sys.stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        ctypes.CDLL(None).fflush(None)  # C stdio buffers too, before fd 1 moves back
        os.dup2(saved, 1)
        os.close(saved)


def attention_cases(arch: str, head_dims, impls=None):
    """(meta, fn, abstract args): one jit per kernel pass, so each holds one Mosaic kernel (the
    dq/dkv split relies on jit dropping the unused kernel; XLA compiles them in any order)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from pallas_kernels.flash_attention.api import flash_attention_bwd, flash_attention_fwd
    from pallas_kernels.flash_attention.config import default_config

    for impl in impls or ATTENTION_IMPLS[arch]:
        for d in head_dims:
            cfg = default_config(impl, d)
            q = jax.ShapeDtypeStruct((B, SEQ, HQ, d), jnp.bfloat16)
            kv = jax.ShapeDtypeStruct((B, SEQ, HKV, d), jnp.bfloat16)
            kw = dict(causal=True, impl=impl, config=cfg)
            # Segment ids add masking code (and SMEM tiles) to every kernel: both variants.
            for seg in (None, jax.ShapeDtypeStruct((B, SEQ), jnp.int32)):
                meta = dict(op="attention", impl=impl, head_dim=d, config=repr(cfg),
                            variant="causal" + ("+segments" if seg is not None else ""))
                segs = () if seg is None else (seg,)

                def fwd(q, k, v, *s, kw=kw):
                    return flash_attention_fwd(q, k, v, *s, **kw)

                lse = jax.eval_shape(fwd, q, kv, kv, *segs)[1]
                yield dict(meta, **{"pass": "fwd"}), fwd, (q, kv, kv, *segs)
                if impl == "mosaic_sm90":  # the opt-in FA3 forms beside the shipped forward
                    yield _fwd_variant(meta, cfg, (q, kv, kv, *segs), fwd_overlap=True)
                    yield _fwd_variant(meta, cfg, (q, kv, kv, *segs), fwd_persistent=True)
                    if d <= PERSISTENT_OVERLAP_MAX_HEAD_DIM:  # beyond it: the grid form
                        yield _fwd_variant(meta, cfg, (q, kv, kv, *segs), fwd_overlap=True,
                                           fwd_persistent=True)
                if impl == "mosaic_sm100" and d <= SM100_MAX_HEAD_DIM:  # FA4's forms
                    yield _fwd_variant(meta, cfg, (q, kv, kv, *segs), fwd_q_tiles=2,
                                       block_kv=64)
                    yield _fwd_variant(meta, cfg, (q, kv, kv, *segs), fwd_exp2_fma=True)
                    # P in TMEM for P V, then with FA4's correction warpgroup as well
                    yield _fwd_variant(meta, cfg, (q, kv, kv, *segs), fwd_p_tmem=True)
                    if seg is None:  # with segment ids it spills 4 B (docs/attention.md)
                        yield _fwd_variant(meta, cfg, (q, kv, kv, *segs), fwd_p_tmem=True,
                                           fwd_correction=True)
                # The dq and dkv kernels (FA2's split), also where the shipped backward is
                # the fused one (sm90 at head_dim <= 128: its A/B alternative, kept compiled).
                split = dataclasses.replace(cfg, bwd_fused=False)
                skw = dict(kw, config=split)
                for name, pick in (("dq", lambda g: g[0]), ("dkv", lambda g: g[1:])):
                    def bwd(q, k, v, o, lse, do, *s, kw=skw, pick=pick):
                        return pick(flash_attention_bwd(q, k, v, s[0] if s else None, o, lse,
                                                        do, **kw))
                    yield (dict(meta, config=repr(split), **{"pass": name}), bwd,
                           (q, kv, kv, q, lse, q, *segs))
                if (impl == "mosaic_sm90" and d <= FUSED_MAX_HEAD_DIM
                        or impl == "mosaic_sm100" and d <= SM100_MAX_HEAD_DIM):
                    # sm90's shipped backward at these head dims; sm100's opt-in
                    yield _fused_bwd(meta, cfg, (q, kv, kv, q, lse, q, *segs))


def _fwd_variant(meta: dict, cfg, args, **knobs):
    """An opt-in forward form (docs/attention.md) as (meta, fn, args): sm90's fwd_overlap
    and/or fwd_persistent (both: FA3's whole forward), sm100's fwd_q_tiles=2 (FA4's two query
    tiles), fwd_exp2_fma (FA4's exp2 emulation) or fwd_p_tmem (+fwd_correction: FA4's P in
    TMEM and correction warpgroup); tagged with its knobs but block_kv."""
    import dataclasses

    from pallas_kernels.flash_attention.api import flash_attention_fwd

    ov = dataclasses.replace(cfg, **knobs)

    def fwd(q, k, v, *s):
        return flash_attention_fwd(q, k, v, *s, causal=True, impl=meta["impl"], config=ov)

    tag = "".join(f"+{k}" if v is True else f"+{k}={v}" for k, v in knobs.items()
                  if k != "block_kv")
    return (dict(meta, config=repr(ov), variant=meta["variant"] + tag,
                 **{"pass": "fwd"}), fwd, args)


def _fused_bwd(meta: dict, cfg, args):
    """The backward with FlashConfig.bwd_fused=True (docs/attention.md, "sm90 fused backward",
    "sm100 fused backward"): one Mosaic kernel for dq, dk and dv."""
    import dataclasses

    from pallas_kernels.flash_attention.api import flash_attention_bwd

    fused = dataclasses.replace(cfg, bwd_fused=True)

    def bwd(q, k, v, o, lse, do, *s):
        return flash_attention_bwd(q, k, v, s[0] if s else None, o, lse, do, causal=True,
                                   impl=meta["impl"], config=fused)

    return (dict(meta, config=repr(fused), variant=meta["variant"] + "+bwd_fused",
                 **{"pass": "dqkv"}), bwd, args)


def overlap_budget_cases(head_dims, regs):
    """(meta, fn, args, budget): the sm90 forward at each head_dim, causal and
    causal+segments, fwd_overlap off and on, compiled at each compute-warpgroup setmaxnreg
    budget in `regs` (0: the shipped kernel_sm90.REGS_COMPUTE): how close each runs to its
    budget (ptxas itself prints the launch split, 168, for all of them)."""
    from pallas_kernels.flash_attention import kernel_sm90

    shipped = kernel_sm90.REGS_COMPUTE
    for meta, fn, args in attention_cases("sm_90a", head_dims, impls=("mosaic_sm90",)):
        if meta["pass"] != "fwd":
            continue
        for reg in regs:
            tag = f" @{reg or shipped} regs"
            yield dict(meta, variant=meta["variant"] + tag), fn, args, reg or shipped


def fused_bwd_cases(head_dims):
    """(meta, fn, args): the sm90 fused backward (FlashConfig.bwd_fused) at every head_dim,
    causal and causal+segments, including those where flash_bwd does not run it yet
    (kernel_sm90_bwd.FUSED_MAX_HEAD_DIM; main lifts the gate for these compiles): the
    register and spill figures of the kernel at head dims still being worked on."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.flash_attention.api import flash_attention_fwd
    from pallas_kernels.flash_attention.config import default_config

    for d in head_dims:
        cfg = default_config("mosaic_sm90", d)
        q = jax.ShapeDtypeStruct((B, SEQ, HQ, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((B, SEQ, HKV, d), jnp.bfloat16)
        lse = jax.eval_shape(lambda q, k, v, cfg=cfg: flash_attention_fwd(
            q, k, v, causal=True, impl="mosaic_sm90", config=cfg), q, kv, kv)[1]
        for seg in (None, jax.ShapeDtypeStruct((B, SEQ), jnp.int32)):
            meta = dict(op="attention", impl="mosaic_sm90", head_dim=d, config=repr(cfg),
                        variant="causal" + ("+segments" if seg is not None else ""))
            yield _fused_bwd(meta, cfg, (q, kv, kv, q, lse, q, *(() if seg is None else (seg,))))


@contextlib.contextmanager
def _fused_gate_lifted(lifted: bool):
    """kernel_sm90_bwd.FUSED_MAX_HEAD_DIM out of the way while the cases compile (lifted)."""
    if not lifted:
        yield
        return
    from pallas_kernels.flash_attention import kernel_sm90_bwd

    shipped, kernel_sm90_bwd.FUSED_MAX_HEAD_DIM = kernel_sm90_bwd.FUSED_MAX_HEAD_DIM, 1 << 30
    try:
        yield
    finally:
        kernel_sm90_bwd.FUSED_MAX_HEAD_DIM = shipped


def fp8_cases(arch: str):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.fp8.api import fp8_matmul
    from pallas_kernels.fp8.config import E4M3, E8M0, MX_BLOCK, GridConfig, Sm90Config, Sm100Config

    m, n, k = FP8_MNK
    a, b = (jax.ShapeDtypeStruct(s, E4M3) for s in ((m, k), (k, n)))
    scales = {"tensorwise": (jax.ShapeDtypeStruct((), jnp.float32),) * 2,
              "rowwise": (jax.ShapeDtypeStruct((m, 1), jnp.float32),
                          jax.ShapeDtypeStruct((1, n), jnp.float32)),
              "mx": (jax.ShapeDtypeStruct((m, k // MX_BLOCK), E8M0),
                     jax.ShapeDtypeStruct((k // MX_BLOCK, n), E8M0))}
    configs = {"sm90": Sm90Config(), "sm100": Sm100Config(), "pallas_grid": GridConfig()}
    # (pallas_grid is not a GPU kernel: fp8_matmul refuses it on GPU, docs/fp8.md.)
    for impl, mode in FP8_IMPLS[arch]:
        def fn(a, sa, b, sb, impl=impl):
            return fp8_matmul(a, sa, b, sb, impl=impl, config=configs[impl])
        meta = {"op": "fp8_matmul", "impl": impl, "pass": "matmul", "head_dim": None,
                "variant": mode, "config": repr(configs[impl])}
        yield meta, fn, (a, scales[mode][0], b, scales[mode][1])
    if arch == "sm_90a":  # the opt-in warp-specialized sm90 variant beside the shipped one
        yield from _sm90_ws_cases(fp8_matmul, Sm90Config, E4M3)


def _sm90_ws_cases(fp8_matmul, Sm90Config, E4M3):
    """Sm90Config(structure="ws_2wg") at its tiles (N = 1536: a multiple of 128, 192, 256),
    and rowwise at 128 x 128 (the widest tile rowwise with promotion takes there)."""
    import jax
    import jax.numpy as jnp

    m, _, k = FP8_MNK
    n = 1536
    ws = dict(structure="ws_2wg", tile_m=128)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    args = (jax.ShapeDtypeStruct((m, k), E4M3), scalar, jax.ShapeDtypeStruct((k, n), E4M3),
            scalar)
    for cfg in (Sm90Config(**ws, tile_n=128), Sm90Config(**ws, tile_n=192,
                                                         max_concurrent_steps=3),
                Sm90Config(**ws, tile_n=256, max_concurrent_steps=3, promote_every=0,
                           epilogue_n=64)):
        def fn(a, sa, b, sb, cfg=cfg):
            return fp8_matmul(a, sa, b, sb, impl="sm90", config=cfg)
        yield ({"op": "fp8_matmul", "impl": "sm90", "pass": "matmul", "head_dim": None,
                "variant": "tensorwise ws_2wg", "config": repr(cfg)}, fn, args)
    cfg = Sm90Config(**ws, tile_n=128)
    rowwise = (jax.ShapeDtypeStruct((m, 1), jnp.float32), jax.ShapeDtypeStruct((1, n), jnp.float32))

    def fn(a, sa, b, sb):
        return fp8_matmul(a, sa, b, sb, impl="sm90", config=cfg)
    yield ({"op": "fp8_matmul", "impl": "sm90", "pass": "matmul", "head_dim": None,
            "variant": "rowwise ws_2wg", "config": repr(cfg)}, fn,
           (args[0], rowwise[0], args[2], rowwise[1]))


def compile_case(kind: str, name: str, fn, args, on_device: bool, log_path: str) -> None:
    import jax

    fn.__name__ = name  # the XLA dump files are named module_N.jit_<name>.*
    with _stdout_to(log_path):
        if on_device:
            jax.jit(fn).lower(*args).compile()
        else:
            from pallas_kernels import aot
            aot.compile_for(kind, fn, *args)


def mosaic_entries(log_text: str) -> list[dict]:
    """The Mosaic kernel of one compile from its stdout dumps (at most one per case)."""
    reports = rep.parse_ptxas(log_text)
    resources = rep.parse_resources(log_text)
    threads = rep.ptx_threads(log_text)
    if not reports:
        return []
    if len(reports) != 1 or len(resources) != 1 or len(threads) != 1:
        raise RuntimeError(f"expected one Mosaic kernel per compile, got {len(reports)} ptxas "
                           f"reports, {len(resources)} Resources, {len(threads)} PTX entries")
    (report,), (res,), (nthreads,) = reports, resources, threads
    return [dict(report, backend="mosaic", threads=nthreads, smem_bytes=res["smem_bytes"],
                 tmem_cols=res["tmem_cols"])]


def triton_entries(dump_dir: str, name: str, sass: bool = False) -> list[dict]:
    """The module's Pallas Triton kernels: their names from the optimized HLO's Triton custom
    calls (the thunk sequence also lists XLA's own fusions), launch threads and shared memory
    from the thunk sequence, and `ptxas -v` run on the module's PTX as XLA dumped it (sass:
    its cubin disassembled and audited too)."""
    def dumped(suffix):
        return glob.glob(os.path.join(dump_dir, f"module_*.jit_{name}.{suffix}"))

    kernels, thunks, reports = set(), {}, {}
    for path in dumped("sm_*_gpu_after_optimizations.txt"):
        kernels |= rep.triton_kernel_names(pathlib.Path(path).read_text())
    for path in dumped("thunk_sequence.txt"):
        thunks.update(rep.parse_thunks(pathlib.Path(path).read_text()))
    if not kernels:
        return []
    audits, ptxas = {}, rep.ptxas_path()
    for ptx in dumped("*ptx"):
        arch = re.search(r"^\.target\s+(sm_\w+)", pathlib.Path(ptx).read_text(), re.M).group(1)
        cubin = ptx + ".cubin" if sass else os.devnull
        out = subprocess.run([ptxas, "-v", f"-arch={arch}", ptx, "-o", cubin],
                             capture_output=True, text=True, check=True)
        reports.update({r["kernel"]: r for r in rep.parse_ptxas(out.stdout + out.stderr)})
        if sass:
            text = subprocess.run([sass_audit.nvdisasm_path() or "nvdisasm", "-ndf", "-c", cubin],
                                  capture_output=True, text=True, check=True).stdout
            audits.update({a["kernel"]: dict(a, ptxas=_version(ptxas))
                           for a in sass_audit.audit_sass(text, arch, kernels)})
    missing = sorted(kernels - set(reports) | kernels - set(thunks))
    if missing:
        raise RuntimeError(f"no PTX or thunk dumped for Triton kernels {missing} (XLA_FLAGS "
                           "need --xla_dump_to and --xla_dump_emitter_re=ptx)")
    return [dict(reports[k], backend="triton", threads=thunks[k][0],
                 smem_bytes=thunks[k][1] + reports[k]["static_smem"], tmem_cols=None,
                 **(_sass_fields(audits.get(k), kernel=k) if sass else {}))
            for k in sorted(kernels)]


def _version(tool: str | None) -> str | None:
    """`tool --version`'s last line ("Cuda compilation tools, release 13.0, V13.0.88")."""
    if tool is None:
        return None
    out = subprocess.run([tool, "--version"], capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if "release" in ln]
    return lines[-1].strip() if lines else None


def _sass_fields(audit: dict | None, kernel: str) -> dict:
    """A record's `sass` (the audit, without its ptxas) and `ptxas` (the version it ran)."""
    if audit is None:
        return dict(sass=dict(kernel=kernel, error="no SASS for this kernel"))
    audit = dict(audit)
    return dict(ptxas=audit.pop("ptxas", None), sass=audit)


def mosaic_sass(log_text: str, arch: str, kernel: str, softmax_warpgroups: int) -> dict:
    """The `sass`/`ptxas` fields of a Mosaic record: its SASS, as MOSAIC_GPU_DUMP_SASS printed
    it into the compile's stdout, audited."""
    found = sass_audit.audit_sass(log_text, arch, softmax_warpgroups=softmax_warpgroups)
    mine = [a for a in found if a["kernel"] == kernel] or found
    if not mine:
        why = ("no SASS in the compile's output (MOSAIC_GPU_DUMP_SASS unset, or no nvdisasm "
               "in the CUDA plugin's nvidia/cuda_nvcc/bin: bash scripts/dev.sh cuda-plugin)")
        return dict(sass=dict(kernel=kernel, error=why))
    return _sass_fields(dict(mine[0], ptxas=_version(sass_audit.xla_ptxas())), kernel)


@contextlib.contextmanager
def _compute_registers(budget: int | None):
    """kernel_sm90.REGS_COMPUTE set to `budget` while a case compiles (None: as shipped)."""
    if budget is None:
        yield
        return
    from pallas_kernels.flash_attention import kernel_sm90

    shipped, kernel_sm90.REGS_COMPUTE = kernel_sm90.REGS_COMPUTE, budget
    try:
        yield
    finally:
        kernel_sm90.REGS_COMPUTE = shipped


def _check_local_gpu(arch: str) -> None:
    import jax
    cc = getattr(jax.devices()[0], "compute_capability", None)
    local = {"9": "sm_90a", "10": "sm_100a"}.get(str(cc).split(".")[0])
    if local != arch:
        raise SystemExit(f"--on-device for {arch}, but the local device is "
                         f"{jax.devices()[0].device_kind} (compute capability {cc})")


def _case_label(meta: dict) -> str:
    return f"{meta['impl']} {meta['pass']} {meta.get('head_dim')} {meta['variant']}"


def _entries(kind: str, arch: str, meta: dict, log_path: str, dump_dir: str, name: str,
             sass: bool) -> list[dict]:
    """The compiled case's kernel records (Mosaic's from its stdout, Triton's from the dump)."""
    log = pathlib.Path(log_path).read_text(errors="replace")
    entries = mosaic_entries(log)
    if sass:
        wgs = 2 if "fwd_q_tiles=2" in meta["variant"] else 1  # softmax WGs per MMA iteration
        entries = [dict(e, **mosaic_sass(log, arch, e["kernel"], wgs)) for e in entries]
    entries += triton_entries(dump_dir, name, sass)
    if not entries:
        raise RuntimeError("no kernel found in the compiled module")
    return entries


def main(argv: list[str]) -> None:
    """argv: KIND OUT [--on-device] [--overlap-budgets=R1,R2,...] [--fused-bwd] [--sass]
    [--only=REGEX] HEAD_DIM..."""
    kind, out_path, *rest = argv
    on_device, fused, sass = "--on-device" in rest, "--fused-bwd" in rest, "--sass" in rest
    only = [a.split("=", 1)[1] for a in rest if a.startswith("--only=")]
    budgets = [a.split("=", 1)[1] for a in rest if a.startswith("--overlap-budgets=")]
    head_dims = [int(x) for x in rest if not x.startswith("--")]
    arch = rep.ARCH[kind]
    if on_device:
        _check_local_gpu(arch)
    dump_dir = os.environ["TITANAX_PTXAS_XLA_DUMP"]
    if budgets:
        cases = list(overlap_budget_cases(head_dims, [int(r) for r in budgets[0].split(",")]))
    elif fused:
        cases = [(*c, None) for c in fused_bwd_cases(head_dims)]
    else:
        cases = [(*c, None) for c in (*attention_cases(arch, head_dims), *fp8_cases(arch))]
    if only:
        cases = [c for c in cases if re.search(only[0], _case_label(c[0]))]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ptxas-log-") as tmp:
        for i, (meta, fn, args, budget) in enumerate(cases):
            name = f"ptxas_case{i}"
            log_path = os.path.join(tmp, f"{name}.log")
            base = dict(meta, gpu=kind, arch=arch)
            try:
                with _compute_registers(budget), _fused_gate_lifted(fused):
                    compile_case(kind, name, fn, args, on_device, log_path)
                entries = _entries(kind, arch, meta, log_path, dump_dir, name, sass)
            except Exception as e:  # one broken case must not hide the others' reports
                msg = " ".join(f"{type(e).__name__}: {e}".split())  # one line, for tables
                rows.append(dict(base, error=msg[:400]))
                continue
            rows += [dict(base, **e) for e in entries]
    with open(out_path, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1:])
