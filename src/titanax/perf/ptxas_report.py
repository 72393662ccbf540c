"""Machine-code reports of every titanax GPU kernel, without a GPU: registers per thread,
spills, stack, shared memory, TMEM columns and threads per CTA as ptxas assigns them, checked
against the budgets of an H100 / B200 SM.

    rows = collect("h100")            # deviceless compiles for sm_90a (needs the CUDA plugin)
    problems = check(rows)            # [] when no kernel spills or overflows
    print(markdown_table(rows))

Why: a kernel that spills registers to local memory, or that needs more registers or shared
memory than an SM has, still compiles (or fails only at launch) and computes the right values,
so no correctness test notices; ptxas knows at compile time, and compiling is all a CPU machine
can do for a GPU.

Where the numbers come from: Mosaic GPU kernels (mosaic_sm90/sm100 attention, the sm90/sm100
FP8 matmuls) are turned into PTX and run through ptxas inside XLA's compile; with
MOSAIC_GPU_DUMP_PTX/PTXAS/RESOURCES set, Mosaic prints the PTX (threads: .maxntid), the
`ptxas -v` report and its Resources (SMEM scratch, TMEM columns) to stdout. Not
MOSAIC_GPU_DUMP_TO: a dump folder turns on every dump, an ~80 MB MLIR pass log per kernel
among them, which doubles the compile time. Triton-backend kernels (impl="triton" attention
and the grid backward that mosaic impls fall back to at head_dim 256; the FP8 `pallas_grid`
matmul is CPU-only) are compiled by XLA: it dumps each module's PTX (--xla_dump_emitter_re=ptx) and thunk
sequence (launch threads and shared memory), and the worker runs the CUDA plugin's `ptxas -v`
on that PTX, keeping the Pallas kernels' entries (XLA's own fusions are left out).
The compiles run in a subprocess per GPU kind (ptxas_worker.py), as Mosaic GPU keeps the first
target's architecture for the whole process. collect(..., sass=True) adds each kernel's SASS
audit (titanax.perf.sass_audit: main loop, wgmma overlap windows, a cycle bound per tile, the
overlaps its config declares).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ARCH = {"h100": "sm_90a", "h200": "sm_90a", "b200": "sm_100a", "gb200": "sm_100a"}


@dataclasses.dataclass(frozen=True)
class Budget:
    """Per-CTA limits of Hopper and Blackwell SMs."""

    registers_per_cta: int = 65536  # the SM's register file: one CTA must fit to launch
    smem_bytes: int = 232448  # 227 KiB, the opt-in maximum per block
    tmem_cols: int = 512  # Blackwell tensor memory: 512 columns x 128 lanes per SM


# --- parsers of the compilers' text output ----------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
# ptxas' C751x notes: the function's wgmma instructions run one after another instead of
# overlapping (an accumulator touched inside the pipeline, too few registers, a call): the
# kernel computes the right values at a fraction of the tensor cores' speed.
_SERIAL = re.compile(r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async instructions "
                     r"are serialized (.*?) in the function '([^']+)'")


def parse_ptxas(text: str) -> list[dict]:
    """Entry functions of `ptxas -v` output, in order: kernel, arch, registers, stack_bytes,
    spill_stores, spill_loads, static_smem, wgmma_serialized (None, or ptxas' code and reason).
    Other lines (gmem, device functions' properties, anything interleaved) are skipped."""
    entries, current, props_of, serial = [], None, None, []
    for line in text.splitlines():
        if m := _SERIAL.search(line):
            serial.append((len(entries), m.group(3), f"{m.group(1)}: {m.group(2)}"))
        elif m := _ENTRY.search(line):
            current = dict(kernel=m.group(1), arch=m.group(2), registers=None, stack_bytes=0,
                           spill_stores=0, spill_loads=0, static_smem=0, wgmma_serialized=None)
            entries.append(current)
            props_of = None
        elif m := _PROPS.search(line):
            props_of = m.group(1)
        elif (m := _FRAME.search(line)) and current and props_of == current["kernel"]:
            current.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif (m := _USED.search(line)) and current and current["registers"] is None:
            current["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                current["static_smem"] = int(s.group(1))
    for seen, kernel, why in serial:  # the function's entry before the note, else after it
        named = [i for i, e in enumerate(entries) if e["kernel"] == kernel]
        before = [i for i in named if i < seen]
        if named:
            entries[(before or named)[-1 if before else 0]]["wgmma_serialized"] = why
    return entries


def parse_resources(text: str) -> list[dict]:
    """Mosaic GPU's `Resources(smem_scratch_bytes=..., tmem_scratch_cols=...,
    tmem_collective_scratch_cols=..., ...)` lines: smem_bytes and tmem_cols (both TMEM kinds)."""
    out = []
    for m in re.finditer(r"Resources\(smem_scratch_bytes=(\d+), tmem_scratch_cols=(\d+), "
                         r"tmem_collective_scratch_cols=(\d+)", text):
        out.append(dict(smem_bytes=int(m.group(1)), tmem_cols=int(m.group(2)) + int(m.group(3))))
    return out


def ptx_threads(text: str) -> list[int]:
    """Threads per CTA of each PTX entry in `text`, from its .maxntid or .reqntid directive."""
    return [int(x) * int(y) * int(z) for x, y, z in
            re.findall(r"^\s*\.(?:maxntid|reqntid)\s+(\d+),\s*(\d+),\s*(\d+)", text, re.M)]


def parse_thunks(text: str) -> dict[str, tuple[int, int]]:
    """XLA's thunk_sequence dump -> {kernel: (threads per CTA, shared memory bytes)} of its
    custom kernels (the Triton calls: Pallas grid kernels)."""
    out = {}
    for m in re.finditer(r"kCustomKernel\b.*?(\S+) grid: \[[^\]]*\] threads: \[(\d+), (\d+), "
                         r"(\d+)\]\s+shared_memory: (\d+) bytes", text):
        out[m.group(1)] = (int(m.group(2)) * int(m.group(3)) * int(m.group(4)), int(m.group(5)))
    return out


def triton_kernel_names(hlo_text: str) -> set[str]:
    """Names of the Pallas Triton kernels (`__gpu$xla.gpu.triton` custom calls) of an HLO
    module's text: the name attribute in their backend_config."""
    return {re.findall(r', name = "([^"]+)"', line)[-1] for line in hlo_text.splitlines()
            if "__gpu$xla.gpu.triton" in line and ', name = "' in line}


def ptxas_path() -> str:
    """The CUDA plugin's ptxas (the one XLA uses; pip's nvidia-cuda-nvcc), else one on PATH."""
    from pallas_kernels import aot
    for root in (str(aot.CUDA_PLUGIN_DIR), *sys.path):
        path = pathlib.Path(root or ".") / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
        if path.is_file():
            return str(path)
    found = shutil.which("ptxas")
    if found is None:
        raise FileNotFoundError("no ptxas: install the CUDA plugin (bash scripts/dev.sh cuda-plugin)")
    return found


# --- collect, check, render -------------------------------------------------------------------

def _worker_env(dump_dir: str, on_device: bool, sass: bool = False) -> dict:
    from pallas_kernels import aot
    env = aot.cuda_plugin_env() if not on_device else dict(os.environ)
    if on_device:
        env.pop("JAX_PLATFORMS", None)  # the tests' "cpu" would hide the GPU
        if aot.plugin_available():
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(aot.CUDA_PLUGIN_DIR), env.get("PYTHONPATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH"), str(aot.REPO), str(aot.REPO / "src")) if p)
    env.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_RESOURCES="1",
               TITANAX_PTXAS_XLA_DUMP=dump_dir)
    env.pop("MOSAIC_GPU_DUMP_TO", None)  # would turn on every dump (see the module docstring)
    if sass:  # the kernel's SASS too (jaxlib runs nvdisasm: titanax.perf.sass_audit)
        env["MOSAIC_GPU_DUMP_SASS"] = "1"
    # Only our modules, only their PTX and thunk sequences beside the HLO text.
    env["XLA_FLAGS"] = " ".join((env.get("XLA_FLAGS", ""), f"--xla_dump_to={dump_dir}",
                                 "--xla_dump_emitter_re=ptx",
                                 "--xla_dump_hlo_module_re=.*ptxas_case.*")).strip()
    return env


def collect(kind: str, head_dims=(64, 128, 256), on_device: bool = False, *,
            timeout: int = 900, overlap_budgets=None, fused_bwd: bool = False,
            sass: bool = False, only: str | None = None) -> list[dict]:
    """Compiles every kernel for `kind` (h100/h200: sm_90a; b200/gb200: sm_100a) in a
    subprocess; one row per kernel entry with its verdict ("ok", "why"). Deviceless by default
    (the CUDA plugin of .venv/cuda-plugin); on_device=True compiles for the local GPU, which
    must be of that architecture. overlap_budgets (sm_90a only): instead, the sm90 forward with
    fwd_overlap off and on at each of these compute-warpgroup register budgets (0: shipped;
    ptxas_worker.overlap_budget_cases). fused_bwd (sm_90a only): instead, the fused backward
    (FlashConfig.bwd_fused) at every head dim, its flash_bwd gate lifted
    (ptxas_worker.fused_bwd_cases). sass: each row also gets its SASS audit and declared
    overlaps' status (titanax.perf.sass_audit: `sass`, `ptxas`, `claims`, `claim_problems`);
    only: a regex over "impl pass head_dim variant" picking the cases to compile."""
    if kind not in ARCH:
        raise ValueError(f"unknown GPU kind {kind!r}; known: {sorted(ARCH)}")
    from pallas_kernels import aot
    with tempfile.TemporaryDirectory(prefix=f"ptxas-{kind}-") as tmp:
        out = os.path.join(tmp, "rows.json")
        budgets = ([f"--overlap-budgets={','.join(map(str, overlap_budgets))}"]
                   if overlap_budgets else [])
        cmd = [sys.executable, "-m", "titanax.perf.ptxas_worker", kind, out,
               *(["--on-device"] if on_device else []), *budgets,
               *(["--fused-bwd"] if fused_bwd else []), *(["--sass"] if sass else []),
               *([f"--only={only}"] if only else []), *map(str, head_dims)]
        proc = subprocess.run(cmd, env=_worker_env(os.path.join(tmp, "xla"), on_device, sass),
                              cwd=aot.REPO, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"ptxas worker for {kind} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        with open(out) as f:
            rows = json.load(f)
    if sass:
        from titanax.perf import sass_audit
        rows = [sass_audit.annotate(row) for row in rows]
    return [dict(row, **verdict(row)) for row in rows]


def collect_all(kinds=("h100", "b200"), head_dims=(64, 128, 256), on_device: bool = False,
                sass: bool = False):
    """collect() for several kinds, their subprocesses side by side; rows in `kinds` order."""
    with ThreadPoolExecutor(len(kinds)) as pool:
        results = list(pool.map(lambda k: collect(k, head_dims, on_device, sass=sass), kinds))
    return [row for rows in results for row in rows]


def verdict(row: dict, budget: Budget = Budget()) -> dict:
    """{"ok": bool, "why": "ok" or the broken budgets} of one kernel row."""
    if "error" in row:
        return dict(ok=False, why=f"compile failed: {row['error']}")
    if row.get("registers") is None:
        return dict(ok=False, why="ptxas reported no register count")
    why = []
    if row["spill_stores"] or row["spill_loads"]:
        why.append(f"spills {row['spill_stores']} B stores / {row['spill_loads']} B loads")
    if row.get("wgmma_serialized"):
        why.append(f"wgmma serialized ({row['wgmma_serialized']})")
    if row["threads"] and row["registers"] * row["threads"] > budget.registers_per_cta:
        why.append(f"{row['registers']} registers x {row['threads']} threads > "
                   f"{budget.registers_per_cta}")
    if row["smem_bytes"] > budget.smem_bytes:
        why.append(f"{row['smem_bytes']} B shared memory > {budget.smem_bytes}")
    if (row.get("tmem_cols") or 0) > budget.tmem_cols:
        why.append(f"{row['tmem_cols']} TMEM columns > {budget.tmem_cols}")
    return dict(ok=not why, why="; ".join(why) or "ok")


def _label(row: dict) -> str:
    hd = f" hd{row['head_dim']}" if row.get("head_dim") else ""
    kernel = f" ({row['kernel']})" if row.get("kernel") else ""
    return f"{row['gpu']} {row['op']} {row['impl']} {row['pass']}{hd} {row['variant']}{kernel}"


def check(rows: list[dict]) -> list[str]:
    """One line per kernel over a budget (or that failed to compile); [] when all are fine."""
    return [f"{_label(r)}: {r['why']}" for r in rows if not r["ok"]]


COLUMNS = (("gpu", "gpu"), ("arch", "arch"), ("op", "op"), ("impl", "impl"), ("pass", "pass"),
           ("head_dim", "hd"), ("variant", "variant"), ("kernel", "kernel"),
           ("threads", "threads"), ("registers", "regs"), ("spill_stores", "spill st B"),
           ("spill_loads", "spill ld B"), ("stack_bytes", "stack B"), ("smem_bytes", "smem B"),
           ("tmem_cols", "tmem cols"), ("why", "verdict"), ("config", "config"))


def markdown_table(rows: list[dict]) -> str:
    """One line per row; columns no row has a value for (head_dim of matmuls, TMEM on
    Hopper) are left out."""
    def cell(row, key):
        v = row.get(key)
        if key == "kernel" and row.get("backend"):
            v = f"`{v}` ({row['backend']})"
        elif key == "config" and v:
            v = f"`{v}`"
        elif key == "why" and not row.get("ok"):
            v = f"**{v if len(v) <= 200 else v[:200] + ' ...'}**"  # compiler errors run long
        return "" if v is None else " ".join(str(v).split()).replace("|", "\\|")

    columns = [(k, t) for k, t in COLUMNS if any(r.get(k) is not None for r in rows)]
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, k) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


BEGIN, END = "<!-- ptxas-report:begin -->", "<!-- ptxas-report:end -->"


def replace_between_markers(text: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    """`text` with everything between the begin and end marker lines replaced by `body`."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no {begin} ... {end} section")
    return text[:start + len(begin)] + "\n" + body.strip("\n") + "\n" + text[stop:]


def between_markers(text: str, begin: str = BEGIN, end: str = END) -> str:
    """What `text` holds between the marker lines, stripped."""
    return text[text.index(begin) + len(begin):text.index(end)].strip()
