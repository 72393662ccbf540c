"""A static audit of the SASS (the machine code the GPU runs) of titanax's kernels, without a
GPU: what each kernel's main loop issues per tile, which matmuls are in flight while the
softmax runs, and a cycle bound per tile from the instruction counts.

    fns = parse_sass(nvdisasm_text)                 # functions: instructions and labels
    audit = audit_function(fns[0], "sm_90a")        # JSON-able: loops, counts, windows, bound
    missing = check_claims(audit, claims_for(row))  # [] when each declared overlap is there

Why: a kernel written to overlap its softmax with the tensor core (FlashAttention-3's
intra-warpgroup pipelining, fwd_overlap) computes the same values whether or not the overlap
survives compilation; ptxas may place a `wgmma.wait_group` earlier than the PTX has it, or sink
the softmax below it, and only the SASS says which. ptxas_report checks registers and spills;
this checks the schedule.

Where the SASS comes from (titanax.perf.ptxas_worker --sass): Mosaic GPU kernels print it with
MOSAIC_GPU_DUMP_SASS=1 (jaxlib runs `$CUDA_ROOT/bin/nvdisasm -ndf -c` on the kernel's cubin,
CUDA_ROOT being jax's CUDA path, the CUDA plugin's nvidia/cuda_nvcc); Triton kernels' PTX, as
XLA dumps it, goes through ptxas to a cubin and nvdisasm (nvdisasm_path()). nvdisasm is the
`nvidia-cuda-nvdisasm` wheel (scripts/dev.sh setup_nvdisasm). Which ptxas made the SASS
matters (ptxas 12.9 and 13.0 schedule fwd_overlap's waits differently): Mosaic kernels get the
one XLA finds first on PATH (xla_ptxas(): the machine's CUDA 13.0 here), Triton kernels the
CUDA plugin's, as in ptxas_report; each row records its `ptxas --version`.

The audit is in parts, each a module of one job: sass_parse (SASS text to functions,
instruction classes, loops), sass_cost (matmul shapes, the static bound per tile), sass_windows
(wgmma windows, the schedule line), sass_claims (the declared overlaps and their check) and
sass_table (the docs' table); this module finds each kernel's role loops, audits a function
and locates the tools. Their public names are importable from here.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

from titanax.perf.sass_claims import (
    OVERLAP_CLAIMS,
    Claim,
    annotate,
    check_claims,
    claim_holds,
    claim_status,
    claims_for,
    problems,
)
from titanax.perf.sass_cost import TENSOR_FLOP_PER_CLK, a_in_tmem, bound, mma_shape
from titanax.perf.sass_parse import (
    _TARGET,
    CLASSES,
    MMA_BLACKWELL,
    MMA_HOPPER,
    MMA_WARP,
    Function,
    Instr,
    Loop,
    classify,
    counts,
    find_loops,
    parse_sass,
)
from titanax.perf.sass_table import BEGIN, END, SASS_COLUMNS, markdown_table
from titanax.perf.sass_windows import WINDOW_CLASSES, _wgmma, loop_windows, schedule

__all__ = ["BEGIN", "CLASSES", "END", "MMA_BLACKWELL", "MMA_HOPPER", "MMA_WARP", "OVERLAP_CLAIMS",
           "SASS_COLUMNS", "TENSOR_FLOP_PER_CLK", "WINDOW_CLASSES", "Claim", "Function", "Instr",
           "Loop", "a_in_tmem", "annotate", "audit_function", "audit_sass", "bound",
           "check_claims", "claim_holds", "claim_status", "claims_for", "classify", "counts",
           "find_loops", "loop_windows", "markdown_table", "mma_shape", "nvdisasm_path",
           "parse_sass", "problems", "register_release_problems", "roles", "schedule",
           "xla_ptxas"]

# --- one kernel's audit --------------------------------------------------------------------------

def _waits_after_ex2(body: list[Instr]) -> int:
    """mbarrier waits (SYNCS.PHASECHK) the loop issues after its first MUFU.EX2."""
    first = next((k for k, i in enumerate(body) if classify(i) == "ex2"), len(body))
    return sum(i.op.startswith("SYNCS.PHASECHK") for i in body[first:])


def _innermost(loops: list[Loop], keep) -> list[Loop]:
    """The loops for which keep(loop) holds and no loop nested inside them does."""
    chosen = [lp for lp in loops if keep(lp)]
    return [lp for lp in chosen if not any(o.blocks < lp.blocks for o in chosen)]


def _n(loop: Loop, cls: str) -> int:
    return sum(classify(i) == cls for i in loop.body)


def roles(fn: Function) -> dict[str, Loop | None]:
    """The main loop ("mma": most matmuls, ties to the shortest body), the softmax loop of a
    warp-specialized kernel ("softmax": most MUFU.EX2, where the MMA loop has none), the TMA
    producer loop ("tma": most TMA copies, no matmul) and, beside a softmax loop, a correction
    loop ("correction": TMEM loads and stores and FP32 math, no matmul, EX2 or TMA: the sm100
    forward's fwd_correction warpgroup rescaling O)."""
    loops = find_loops(fn)

    def pick(cands, cls):
        return max(cands, key=lambda lp: (_n(lp, cls), -len(lp.body)), default=None)

    mma = pick(_innermost(loops, lambda lp: _n(lp, "mma") > 0), "mma")
    softmax = None
    if mma is None or _n(mma, "ex2") == 0:
        softmax = pick(_innermost(loops, lambda lp: _n(lp, "ex2") > 0 and _n(lp, "mma") == 0),
                       "ex2")
    tma = pick(_innermost(loops, lambda lp: _n(lp, "mma") == 0 and any(
        i.base in ("UTMALDG", "UBLKCP") for i in lp.body)), "tma")
    correction = None
    if softmax is not None:
        correction = pick(_innermost(loops, lambda lp: lp is not softmax and all(
            _n(lp, c) == 0 for c in ("mma", "ex2", "tma")) and _n(lp, "fp32") > 0 and {
                "LDTM", "STTM"} <= {i.base for i in lp.body}), "tmem")
    out = dict(mma=mma, softmax=softmax, tma=tma)
    if correction is not None:
        out["correction"] = correction
    return out


def _mma_kinds(fn: Function, body: list[Instr]) -> str:
    kinds: dict[str, int] = {}
    for ins in body:
        if classify(ins) == "mma":
            shape = mma_shape(fn, ins)
            name = ins.op if ins.base not in MMA_BLACKWELL or shape is None else \
                f"{ins.base}.{shape[0]}x{shape[1]}x{shape[2]}"
            kinds[name] = kinds.get(name, 0) + 1
    return ", ".join(f"{n}x {k}" for k, n in kinds.items())


def register_release_problems(fn: Function) -> list[str]:
    """A warpgroup that gives registers back to the CTA's pool (setmaxnreg.dec:
    USETMAXREG.DEALLOC) must do so before it waits on an mbarrier (SYNCS.PHASECHK): the other
    warpgroups' setmaxnreg.inc (USETMAXREG.TRY_ALLOC, retried until it succeeds) waits for those
    registers, and an mbarrier they complete only after their increase never completes. The
    sm90 dkv and fused backwards with segment ids hung on an H200 so (docs/performance.md); no
    interpreter shows it. Walks back from each DEALLOC to the start of its warpgroup's code:
    the nearest label an earlier branch jumps forward to (a wait's retry stub jumps back from
    later addresses: its return label is passed), or an unpredicated EXIT / BRA."""
    role_starts = set()
    for ins in fn.instrs:
        for label in _TARGET.findall(ins.args):
            if fn.labels.get(label, -1) > ins.index:
                role_starts.add(fn.labels[label])
    out = []
    for ins in fn.instrs:
        if not ins.op.startswith("USETMAXREG.DEALLOC"):
            continue
        k = ins.index
        while k > 0 and k not in role_starts:
            k -= 1
            prev = fn.instrs[k]
            if prev.base == "SYNCS" and "PHASECHK" in prev.op:
                out.append(f"mbarrier wait at {prev.addr:04x} before its warpgroup gives "
                           f"registers back (USETMAXREG.DEALLOC at {ins.addr:04x}): another "
                           "warpgroup's setmaxnreg.inc can wait for them forever")
                break
            if not prev.pred and prev.base in ("EXIT", "BRA", "RET"):
                break
    return out


def audit_function(fn: Function, arch: str, softmax_warpgroups: int = 1) -> dict:
    """JSON-able audit of one kernel function: per role loop its counts by class, schedule and
    (Hopper) wgmma windows; the static bound per tile (a warp-specialized kernel's softmax loop
    counted once per softmax warpgroup fed by one MMA-loop iteration); or `error` when it has
    no matmul loop."""
    found = roles(fn)
    mma = found["mma"]
    order = register_release_problems(fn)
    if mma is None:
        return dict(kernel=fn.name, error="no loop issues a matmul", register_order=order)
    out = dict(kernel=fn.name, arch=arch, loops=len(find_loops(fn)), register_order=order)
    for role, loop in found.items():
        if loop is not None:
            out[role] = dict(at=f"{loop.body[0].addr:04x}-{loop.body[-1].addr:04x}",
                             counts=counts(loop.body), schedule=schedule(loop.body),
                             mma_kinds=_mma_kinds(fn, loop.body) if role == "mma" else "")
            if role == "mma" and any(i.base in MMA_BLACKWELL for i in loop.body):
                out[role]["a_tmem"] = sum(a_in_tmem(i) for i in loop.body)
            if role == "softmax":
                out[role]["waits_after_ex2"] = _waits_after_ex2(loop.body)
    if any(_wgmma(i) for i in mma.body):
        out["mma"].update(loop_windows(mma.body))
    work = found["softmax"] or mma
    repeat = softmax_warpgroups if found["softmax"] else 1
    out["bound"] = bound(fn, mma.body, work.body, arch, repeat)
    return out


def audit_sass(text: str, arch: str, kernels=None, softmax_warpgroups: int = 1) -> list[dict]:
    """audit_function for each function of `text` (only those named in `kernels`, if given)."""
    return [audit_function(f, arch, softmax_warpgroups) for f in parse_sass(text)
            if kernels is None or f.name in kernels]


# --- tools ---------------------------------------------------------------------------------------

def _plugin_tool(name: str) -> str | None:
    """The CUDA plugin's nvidia/cuda_nvcc/bin/<name> (.venv/cuda-plugin or sys.path), or None."""
    from pallas_kernels import aot
    for root in (str(aot.CUDA_PLUGIN_DIR), *sys.path):
        path = pathlib.Path(root or ".") / "nvidia" / "cuda_nvcc" / "bin" / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def nvdisasm_path() -> str | None:
    """nvdisasm where jaxlib's MOSAIC_GPU_DUMP_SASS runs it ($CUDA_ROOT/bin, CUDA_ROOT being
    jax's CUDA path: the CUDA plugin's nvidia/cuda_nvcc, where scripts/dev.sh links it), else
    one on PATH; None if there is none."""
    return _plugin_tool("nvdisasm") or shutil.which("nvdisasm")


def xla_ptxas() -> str | None:
    """The ptxas that compiles Mosaic kernels here: XLA looks on PATH before the CUDA plugin's
    own (stream_executor's FindCudaExecutable; Mosaic passes no preferred CUDA directory), so a
    CUDA toolkit on PATH wins (CUDA 13.0 on these machines). None if there is none."""
    return shutil.which("ptxas") or _plugin_tool("ptxas")
