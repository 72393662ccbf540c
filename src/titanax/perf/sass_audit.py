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

How the loop is found: the function's control-flow graph (basic blocks split at labels and
branches), its natural loops (a back edge u -> h where h dominates u; the mbarrier try-wait
retry stubs ptxas places after the function's EXIT branch back into the loop but are not
dominated by its header, so they are no loops and are left out of the body, which is the
in-line instructions from the header to the last back branch). The main loop is the innermost
loop with the most matmul instructions (HGMMA/QGMMA on Hopper, UTC*MMA on Blackwell, HMMA
anywhere: mma.sync, as Triton's unpipelined kernels issue), ties to
the shortest body (the unmasked fast path); warp-specialized kernels also get their softmax
loop (the most MUFU.EX2, where the MMA loop has none: sm100's softmax warpgroups) and their TMA
producer loop (UTMALDG/UBLKCP, no matmul). Counts are static: one iteration's instructions,
both sides of a branch inside the body included.

Overlap windows (Hopper's wgmma; loop_windows): a chain of HGMMAs ending in one with `gsb0` is
a committed group; `WARPGROUP.DEPBAR.LE gsb0, N` waits until at most N groups are outstanding,
retiring the oldest first. A group's window runs from its first HGMMA to the DEPBAR that
retires it; the audit walks the loop body twice (a group committed in iteration j may be waited
for in j+1) and counts, by class, what is issued inside each window, and over the second walk
how many of each class are issued while any group is in flight ("overlapped"). Blackwell's
tcgen05 MMAs complete through mbarriers (UTCBAR) that other warps wait on: their overlap is
between warps, so sm100 kernels get counts, schedule and bound but no windows. What the SASS
does say about them, and their claims check (Claim units "a_tmem" and "softmax_waits"): which
UTC*MMAs read their A operand from TMEM (`UTCHMMA tmem[..], gdesc[..], ..`: the P V of
FlashConfig.fwd_p_tmem), and whether the softmax loop waits on an mbarrier after its first
MUFU.EX2 (the shipped forward's wait for P_{t-1} V before it rescales O; fwd_correction moves
that to a correction warpgroup, whose loop, no matmul and no EX2 but TMEM loads and stores,
is the "correction" role).

The static bound per tile (bound()): the largest of the units' busy times for one iteration of
the main loop by one warpgroup, its 4 warps issuing on the SM's 4 sub-partitions (SMSPs) side by
side. AN ESTIMATE: it ignores latencies, dependencies, dual issue, bank conflicts and the
tensor core's operand reads from shared memory; it says which unit a tile cannot beat. Costs
(clock cycles of the SM, per warp instruction unless stated):

- tensor core: FLOPs / (FLOP per clock per SM); an HMMA (mma.sync, per warp) counts 4 times,
  once per warp of the warpgroup, at the same rate (an upper bound: mma.sync does not reach
  wgmma's rate on Hopper). Hopper: 4096 dense bf16/fp16, 8192 fp8 (A100's
  tensor cores do 2048 dense fp16 FLOP/clk/SM: 312 TFLOP/s / (108 SMs x 1.41 GHz); Hopper
  doubles it per SM per clock (H100 whitepaper), so an H100 SXM's 989 TFLOP/s is 4096 x 132
  SMs x 1.83 GHz). An HGMMA.64x128x16 is 2 x 64 x 128 x 16 = 262,144 FLOP = 64 clk; a
  QGMMA.64x128x32 likewise 64 clk. Blackwell (sm_100): twice Hopper per SM per clock, 8192 bf16
  and 16384 fp8 (B200's 2.25 PFLOP/s dense bf16 = 8192 x 148 SMs x 1.86 GHz); a UTCHMMA's shape
  is read from its instruction descriptor (the UMOV that loads idesc's register: N >> 3 in bits
  17-22, M >> 4 in bits 24-28, or M >> 7 in bits 27-28 for the block-scaled kinds; K = 16 for
  UTCHMMA (16-bit), 32 for UTCQMMA (8-bit), per the PTX ISA's tcgen05 instruction descriptor).
- MUFU (exp2, rcp, lg2): 16 lanes per clock per SM, 4 per SMSP (H100 whitepaper: 4 SFUs per
  SMSP; FlashAttention-4 uses the same 16/clk/SM for Blackwell): 8 clk per warp instruction.
- FP32 FMA pipe (FFMA, FMUL, FADD; HFMA2 and friends): 128 lanes per clock per SM, 32 per SMSP:
  1 clk; Blackwell's paired FFMA2/FMUL2/FADD2 do two per lane: 2 clk.
- ALU (integer, logic, compare, select, min/max, float conversions: ISETP, LOP3, FSEL, FMNMX,
  F2FP, ...): 64 lanes per clock per SM (16 INT32 lanes per SMSP): 2 clk.
- shared memory (LDS/STS/LDSM/STSM/ATOMS): 128 bytes per clock per SM; one warp's LDS.128 is
  512 B, and the 4 warps of the warpgroup each issue it: 16 clk.
- issue: one warp instruction per clock per SMSP: 1 clk for every instruction (uniform-datapath,
  barrier and branch instructions included).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import sys

# --- parsing -------------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?"
                    r"([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_\w+):")
_FUNC = re.compile(r"^\.text\.(\S+):")
_TARGET = re.compile(r"`\((\.L_\w+)\)")
_COND = re.compile(r"^!?U?P[T0-9]+\s*,")  # BRA.U !UP0, `(...)`: a predicate operand


@dataclasses.dataclass(frozen=True)
class Instr:
    index: int
    addr: int
    pred: str  # "" or "@!P1"
    op: str  # "HGMMA.64x128x16.F32.BF16"
    args: str  # "R24, gdesc[UR20], R24, gsb0"

    @property
    def base(self) -> str:
        return self.op.split(".", 1)[0]

    def __str__(self) -> str:
        return f"/*{self.addr:04x}*/ {self.pred + ' ' if self.pred else ''}{self.op} {self.args}"


@dataclasses.dataclass
class Function:
    name: str
    instrs: list[Instr]
    labels: dict[str, int]  # label -> index of the instruction after it


def parse_sass(text: str) -> list[Function]:
    """The functions of nvdisasm's `-c` output, in order; lines that are no SASS (PTX, ptxas
    reports, directives: a Mosaic dump interleaves them) are skipped."""
    functions, current = [], None
    for line in text.splitlines():
        if m := _FUNC.match(line):
            current = Function(m.group(1), [], {})
            functions.append(current)
        elif current is None:
            continue
        elif m := _LABEL.match(line):
            current.labels[m.group(1)] = len(current.instrs)
        elif m := _INSTR.match(line):
            current.instrs.append(Instr(len(current.instrs), int(m.group(1), 16),
                                        (m.group(2) or "").strip(), m.group(3), m.group(4)))
    return [f for f in functions if f.instrs]


# --- instruction classes -------------------------------------------------------------------------

MMA_HOPPER = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")
MMA_BLACKWELL = ("UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCIMMA", "UTCMMA")
MMA_WARP = ("HMMA",)  # mma.sync, one warp's (Triton's unpipelined kernels)
_FP32 = {"FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "FFMA2", "FMUL2", "FADD2"}
_PAIRED = {"FFMA2", "FMUL2", "FADD2"}
_SMEM = {"LDS", "STS", "LDSM", "STSM", "ATOMS"}
_SYNC = {"BAR", "SYNCS", "WARPGROUP", "DEPBAR", "MEMBAR", "FENCE", "UTCBAR", "WARPSYNC",
         "NANOSLEEP", "YIELD", "CCTL", "ERRBAR", "ELECT"}
_TMA = {"UTMALDG", "UTMASTG", "UTMAREDG", "UBLKCP", "UTMACCTL", "UTMACMDFLUSH", "UTCCP",
        "UTMAPF", "UBLKRED"}
_BRANCH = {"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL", "BSSY", "BSYNC", "BPT", "WARPSYNC"}
_GMEM = {"LDG", "STG", "LD", "ST", "RED", "ATOM", "ATOMG", "LDC", "LDCU", "LDGSTS"}
_TMEM = {"LDTM", "STTM"}
_MISC = {"NOP", "S2R", "S2UR", "CS2R", "SHFL", "MOV", "R2UR", "UMOV", "VOTE", "VOTEU", "MATCH",
         "REDUX", "BMOV", "P2R", "R2P", "PMTRIG", "USETMAXREG", "UTCATOMSWS"}
CLASSES = ("mma", "ex2", "mufu", "fp32", "alu", "smem", "tmem", "sync", "tma", "gmem", "branch",
           "uniform", "other")


def classify(ins: Instr) -> str:
    b = ins.base
    if b in MMA_HOPPER or b in MMA_BLACKWELL or b in MMA_WARP:
        return "mma"
    if b == "MUFU":
        return "ex2" if ins.op.startswith("MUFU.EX2") else "mufu"
    for cls, names in (("fp32", _FP32), ("smem", _SMEM), ("tmem", _TMEM), ("sync", _SYNC),
                       ("tma", _TMA), ("gmem", _GMEM), ("branch", _BRANCH)):
        if b in names:
            return cls
    if b in _MISC:
        return "uniform" if b.startswith("U") or b in ("R2UR", "S2UR", "VOTEU") else "other"
    if b.startswith("U"):  # UIADD3, ULOP3, USHF, ...: the uniform datapath, one per warp
        return "uniform"
    return "alu"


def counts(instrs) -> dict[str, int]:
    out = dict.fromkeys(CLASSES, 0)
    for ins in instrs:
        out[classify(ins)] += 1
    out["total"] = len(instrs)
    return out


# --- control flow and loops ----------------------------------------------------------------------

def _blocks(fn: Function):
    """Basic blocks as (start, end) instruction ranges (end exclusive) and their successors."""
    n, leaders = len(fn.instrs), {0}
    leaders |= {i for i in fn.labels.values() if i < n}
    for ins in fn.instrs:
        if ins.base in ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "BPT"):
            leaders.add(ins.index + 1)
    starts = sorted(s for s in leaders if s < n)
    ranges = list(zip(starts, starts[1:] + [n]))
    block_at = {s: b for b, (s, _) in enumerate(ranges)}
    succ = []
    for b, (_, end) in enumerate(ranges):
        last = fn.instrs[end - 1]
        conditional = bool(last.pred) or bool(_COND.match(last.args))
        nxt = [b + 1] if b + 1 < len(ranges) else []
        if last.base == "BRA" and (t := _TARGET.search(last.args)) and t.group(1) in fn.labels:
            target = [block_at[fn.labels[t.group(1)]]] if fn.labels[t.group(1)] < n else []
            succ.append(target + (nxt if conditional else []))
        elif last.base in ("EXIT", "RET", "BPT") and not conditional:
            succ.append([])
        else:
            succ.append(nxt)
    return ranges, succ


def _dominators(succ: list[list[int]]) -> list[set[int]]:
    n = len(succ)
    pred = [[] for _ in range(n)]
    for b, ss in enumerate(succ):
        for s in ss:
            pred[s].append(b)
    everything = set(range(n))
    dom = [{0}] + [set(everything) for _ in range(n - 1)]
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            new = set.intersection(*(dom[p] for p in pred[b])) if pred[b] else set()
            new = new | {b}
            if new != dom[b]:
                dom[b], changed = new, True
    return dom


@dataclasses.dataclass
class Loop:
    header: int  # first instruction index
    end: int  # last back branch's index
    blocks: frozenset
    body: list[Instr]  # in-line instructions, in program order


def find_loops(fn: Function) -> list[Loop]:
    """Natural loops (back edges to a dominating header), merged per header; their bodies are
    the loop's instructions between the header and the last back branch (out-of-line blocks,
    such as retry stubs placed after the function's end, are left out)."""
    ranges, succ = _blocks(fn)
    dom = _dominators(succ)
    pred = [[] for _ in succ]
    for b, ss in enumerate(succ):
        for s in ss:
            pred[s].append(b)
    by_header: dict[int, tuple[set, int]] = {}
    for u, ss in enumerate(succ):
        for h in ss:
            if h not in dom[u]:
                continue
            body, stack = {h, u}, [u]
            while stack:
                for p in pred[stack.pop()]:
                    if p not in body:
                        body.add(p)
                        stack.append(p)
            old_body, old_latch = by_header.get(h, (set(), u))
            by_header[h] = (old_body | body, max(old_latch, u))
    loops = []
    for h, (body, latch) in sorted(by_header.items()):
        lo, hi = ranges[h][0], ranges[latch][1]
        inline = [fn.instrs[i] for b in sorted(body) for i in range(*ranges[b]) if lo <= i < hi]
        loops.append(Loop(lo, hi - 1, frozenset(body), inline))
    return loops


# --- matmul shapes and the cost table -----------------------------------------------------------

# Dense FLOP per clock per SM by (arch family, operand bits); see the module docstring.
TENSOR_FLOP_PER_CLK = {("sm_90", 16): 4096, ("sm_90", 8): 8192, ("sm_90", 32): 2048,
                       ("sm_100", 16): 8192, ("sm_100", 8): 16384, ("sm_100", 4): 32768}
_UTC_K = {"UTCHMMA": (16, 16), "UTCQMMA": (32, 8), "UTCOMMA": (64, 4)}  # (K, operand bits)
_WGMMA_BITS = {"HGMMA": 16, "QGMMA": 8, "IGMMA": 8}
MUFU_CLK, FP32_CLK, ALU_CLK, ISSUE_CLK = 8, 1, 2, 1
SMEM_BYTES_PER_CLK, WARPS_PER_WARPGROUP = 128, 4


def _idesc_value(fn: Function, ins: Instr) -> int | None:
    """The constant a UTC*MMA's instruction-descriptor register was last set to (UMOV URx, imm
    before it in program order), or None."""
    reg = re.search(r"idesc\[(UR\d+)\]", ins.args)
    if not reg:
        return None
    for prev in reversed(fn.instrs[:ins.index]):
        if re.match(rf"{reg.group(1)}\b", prev.args):
            m = re.match(rf"{reg.group(1)},\s*(0x[0-9a-f]+|\d+)$", prev.args)
            return int(m.group(1), 0) if prev.base == "UMOV" and m else None
    return None


def mma_shape(fn: Function, ins: Instr) -> tuple[int, int, int, int] | None:
    """(M, N, K, operand bits) of one matmul instruction, or None where the SASS does not say.
    An HMMA's shape is one warp's (HMMA.16816: 16 x 8 x 16)."""
    if ins.base == "HMMA":
        m = re.match(r"HMMA\.(16)(8)(8|16)\.", ins.op)
        bits = 32 if ".TF32" in ins.op else 16
        return (int(m.group(1)), int(m.group(2)), int(m.group(3)), bits) if m else None
    if ins.base in _WGMMA_BITS:
        m = re.match(r"[A-Z]+\.(\d+)x(\d+)x(\d+)", ins.op)
        bits = 32 if ".TF32" in ins.op else _WGMMA_BITS[ins.base]
        return (int(m.group(1)), int(m.group(2)), int(m.group(3)), bits) if m else None
    if ins.base in _UTC_K and (v := _idesc_value(fn, ins)) is not None:
        k, bits = _UTC_K[ins.base]
        # block-scaled kinds: scale factors in TMEM (an A operand in TMEM is one more tmem[])
        scaled = ins.args.count("tmem[") - a_in_tmem(ins) >= 3
        m = ((v >> 27) & 0x3) << 7 if scaled else ((v >> 24) & 0x1F) << 4
        n = ((v >> 17) & 0x3F) << 3
        return (m, n, k, bits) if m and n else None
    return None


def a_in_tmem(ins: Instr) -> bool:
    """A Blackwell MMA whose A operand is read from TMEM (tcgen05.mma [d], [a_tmem], b_desc):
    its first operand is tmem[..] where an SMEM operand is gdesc[..]."""
    return ins.base in MMA_BLACKWELL and ins.args.lstrip().startswith("tmem[")


def _waits_after_ex2(body: list[Instr]) -> int:
    """mbarrier waits (SYNCS.PHASECHK) the loop issues after its first MUFU.EX2."""
    first = next((k for k, i in enumerate(body) if classify(i) == "ex2"), len(body))
    return sum(i.op.startswith("SYNCS.PHASECHK") for i in body[first:])


def _arch_family(arch: str) -> str:
    return "sm_100" if arch.startswith("sm_10") else "sm_90"


def _smem_bytes(ins: Instr) -> int:
    """Bytes one warp moves (at least one 128-byte wavefront)."""
    if ins.base in ("LDSM", "STSM"):
        m = re.search(r"\.M(?:T)?88(?:\.(\d))?", ins.op)
        return 128 * int(m.group(1) or 1) if m else 128
    width = re.search(r"\.(64|128)\b", ins.op)
    return max(128, 32 * int(width.group(1)) // 8) if width else 128


def bound(fn: Function, mma_loop: list[Instr], work_loop: list[Instr], arch: str,
          repeat: int = 1) -> dict:
    """Per-unit busy clocks of one tile and the largest ("bound", its unit "limiter"): the
    tensor core from mma_loop's matmuls, every other unit from work_loop (the same loop, or a
    warp-specialized kernel's softmax loop, run `repeat` times per MMA-loop iteration: once
    per softmax warpgroup). An estimate (module docstring)."""
    tensor, unknown = 0.0, 0
    for ins in mma_loop:
        if classify(ins) == "mma":
            shape = mma_shape(fn, ins)
            if shape is None:
                unknown += 1
                continue
            m, n, k, bits = shape
            warps = WARPS_PER_WARPGROUP if ins.base in MMA_WARP else 1  # each warp issues one
            tensor += warps * 2 * m * n * k / TENSOR_FLOP_PER_CLK[(_arch_family(arch), bits)]
    c = counts(work_loop)
    fp32 = sum(2 if i.base in _PAIRED else 1 for i in work_loop if classify(i) == "fp32")
    smem = sum(_smem_bytes(i) for i in work_loop if classify(i) == "smem")
    units = {"tensor": None if unknown else round(tensor),
             "mufu": repeat * (c["ex2"] + c["mufu"]) * MUFU_CLK, "fp32": repeat * fp32 * FP32_CLK,
             "alu": repeat * c["alu"] * ALU_CLK,
             "smem": round(repeat * smem * WARPS_PER_WARPGROUP / SMEM_BYTES_PER_CLK),
             "issue": repeat * c["total"] * ISSUE_CLK}
    known = {u: v for u, v in units.items() if v is not None}
    limiter = max(known, key=known.get)
    return dict(units, bound=known[limiter], limiter=limiter)


# --- wgmma groups and their windows --------------------------------------------------------------

WINDOW_CLASSES = ("mma", "ex2", "fp32", "alu", "smem", "sync", "total")


def _wgmma(ins: Instr) -> bool:
    return ins.base in MMA_HOPPER


def _chain_name(chain: list[Instr]) -> str:
    first = chain[0]
    regs_a = not first.args.split(",")[1].strip().startswith("gdesc")
    acc = first.args.split(",")[0].strip()
    zero = ", zero-init" if ", RZ" in first.args else ""
    return f"{len(chain)}x {first.op} (A {'regs' if regs_a else 'smem'}, acc {acc}{zero})"


def loop_windows(body: list[Instr]) -> dict:
    """The wgmma groups of one loop iteration and what is issued inside each one's window (its
    first HGMMA to the WARPGROUP.DEPBAR that retires it, possibly in the next iteration), and
    per class how many instructions of the second (steady-state) iteration issue while a group
    other than their own is in flight ("overlapped")."""
    outstanding, chain, groups = [], None, []
    overlapped = dict.fromkeys(WINDOW_CLASSES, 0)
    for it in (0, 1):
        for pos, ins in enumerate(body):
            cls = classify(ins)
            # in flight: the committed groups, and the open chain unless `ins` extends it
            in_flight = outstanding + ([chain] if chain and not _wgmma(ins) else [])
            if _wgmma(ins):
                if chain is None:
                    chain = dict(iteration=it, issued=pos, mma=[], inside=dict.fromkeys(
                        WINDOW_CLASSES, 0), waited=None)
                chain["mma"].append(ins)
                if "gsb0" in ins.args:
                    outstanding.append(chain)
                    groups.append(chain)
                    chain = None
            elif ins.op.startswith("WARPGROUP.DEPBAR") and "gsb0" in ins.args:
                keep = int(ins.args.split(",")[-1], 0)
                while len(outstanding) > keep:
                    outstanding.pop(0)["waited"] = (it, pos)
            for g in in_flight:
                for key in (cls, "total"):
                    if key in g["inside"]:
                        g["inside"][key] += 1
            if it == 1 and in_flight:
                for key in (cls, "total"):
                    if key in overlapped:
                        overlapped[key] += 1
    windows = [dict(chain=_chain_name(g["mma"]), issued_at=g["issued"],
                    waited_at=None if g["waited"] is None else g["waited"][1],
                    waited_in=("same iteration" if g["waited"] and g["waited"][0] == 0 else
                               "next iteration" if g["waited"] else "after the loop"),
                    inside=g["inside"])
               for g in groups if g["iteration"] == 0]
    return dict(windows=windows, overlapped=overlapped)


def schedule(body: list[Instr]) -> str:
    """The loop's synchronisation and matmul events in order, runs compressed: A wgmma fence
    (WARPGROUP.ARRIVE), Mn a chain of n matmuls (Mnr: A from registers), Dn WARPGROUP.DEPBAR.LE
    gsb0 n, C tcgen05 commit (UTCBAR), W mbarrier wait, R mbarrier arrive, B named barrier, eN N
    MUFU.EX2 issued since the previous event."""
    tokens, ex2, chain = [], 0, []

    def flush_chain():
        if chain:
            regs_a = _wgmma(chain[0]) and not chain[0].args.split(",")[1].strip().startswith("g")
            tokens.append(f"M{len(chain)}{'r' if regs_a else ''}")
            chain.clear()

    for ins in body:
        op, cls = ins.op, classify(ins)
        token = ("A" if op == "WARPGROUP.ARRIVE" else
                 f"D{int(ins.args.split(',')[-1], 0)}" if op.startswith("WARPGROUP.DEPBAR") else
                 "C" if ins.base == "UTCBAR" else
                 "W" if op.startswith(("SYNCS.PHASECHK", "SYNCS.WAIT")) else
                 "R" if op.startswith("SYNCS.ARRIVE") else
                 "B" if ins.base == "BAR" else None)
        if cls == "mma":
            if ex2:
                tokens.append(f"e{ex2}")
                ex2 = 0
            chain.append(ins)
            if "gsb0" in ins.args:
                flush_chain()
            continue
        if cls == "ex2":
            ex2 += 1
        if token is None:
            continue
        if chain:
            flush_chain()
        if ex2:
            tokens.append(f"e{ex2}")
            ex2 = 0
        tokens.append(token)
    flush_chain()
    if ex2:
        tokens.append(f"e{ex2}")
    out = []
    for t in tokens:  # runs of one event: "Ax3"
        if out and out[-1][0] == t and t[0] in "ADWRBC":
            out[-1][1] += 1
        else:
            out.append([t, 1])
    return " ".join(t if n == 1 else f"{t}x{n}" for t, n in out)


# --- one kernel's audit --------------------------------------------------------------------------

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


# --- declared overlaps ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Claim:
    """An overlap a kernel config declares, checkable in its SASS: at least `min_fraction` of
    the main loop's instructions of class `unit` ("ex2": MUFU.EX2, "mma": matmuls) issue while a
    wgmma group other than their own is in flight (loop_windows' "overlapped"). Two units
    are Blackwell's structure instead (no wgmma windows there): "a_tmem", at least
    `min_fraction` of the main loop's MMAs read A from TMEM; "softmax_waits", the softmax loop
    waits on no mbarrier after its first exp2 (min_fraction unused).
    known_gap: why the SASS does not show it (yet): the check then expects it missing, so that
    a fix shows up ("known gap closed") as well as a regression. head_dims: the head dims it
    is claimed at (empty: all)."""

    unit: str
    min_fraction: float
    what: str
    known_gap: str = ""
    head_dims: tuple = ()


_FWD_OVERLAP_EX2_GAP = (
    "ptxas moves the wgmma.wait_group 0 for P_{j-1} V_{j-1}, which the PTX places after tile "
    "j's softmax, ahead of it (DEPBAR.LE gsb0, 0x0 a dozen FMNMX after S_j's wait, before the "
    "first MUFU.EX2): with ptxas 13.0 at every head dim, with 12.9 at head_dim 64 (12.9 keeps "
    "64 of the 66 exp2 in the window at 128)")

# (impls, passes, strings that must all appear in the row's variant or config repr, claims).
# A config that claims nothing intra-warpgroup is absent: the shipped sm90 forward waits for
# each wgmma group before using it and overlaps across its two warpgroups (the ping-pong).
OVERLAP_CLAIMS = (
    (("mosaic_sm90",), ("fwd",), ("fwd_overlap=True",), (
        Claim("mma", 0.15, "S_j = Q K_j^T and P_{j-1} V_{j-1} in flight together (P V issued "
                           "before S_j is waited for: 4 of 20 MMAs at head_dim 256)"),
        Claim("ex2", 0.5, "tile j's exp2 under P_{j-1} V_{j-1} (FA3 Algorithm 2)",
              known_gap=_FWD_OVERLAP_EX2_GAP),
    )),
    (("mosaic_sm90",), ("dq", "dkv", "dqkv"), (), (
        Claim("mma", 0.15, "S and dP issued together, one wait (the second chain issues while "
                           "the first is in flight)"),
    )),
    # The fused backward's asynchronous form (kernel_sm90_bwd_fused.py, head_dim <= its
    # ASYNC_MAX_HEAD_DIM; above, the synchronous form claims only the S/dP pair above).
    (("mosaic_sm90",), ("dqkv",), ("bwd_fused=True",), (
        Claim("ex2", 0.9, "P^T = exp2(S^T - lse) while dP^T = V dO^T is in flight (FA3)",
              head_dims=(64,)),
        Claim("fp32", 0.9, "the exp2 FMAs under dP^T and dS^T = P^T (dP^T - delta) under "
                           "dV += P^T dO", head_dims=(64,)),
        Claim("mma", 0.6, "dV, dK and dQ issued as one chain, waited for once (and S^T with "
                          "dP^T)", head_dims=(64,)),
    )),
    # The sm100 forward's FA4 forms (kernel_sm100.py): P V reads P from TMEM (the P V MMAs: 8
    # of 16 at head_dim 128, 8 of 12 at 64); with the correction warpgroup the softmax loop no
    # longer waits for P_{t-1} V after its exponentials (the O rescale's wait).
    (("mosaic_sm100",), ("fwd",), ("fwd_p_tmem=True",), (
        Claim("a_tmem", 0.3, "P_t V_t issued with P read from TMEM (tcgen05 A operand), no "
                             "P tile in SMEM"),
    )),
    (("mosaic_sm100",), ("fwd",), ("fwd_correction=True",), (
        Claim("softmax_waits", 0.0, "no tensor-core wait in the softmax loop after its exp2: "
                                    "the O rescale (after P_{t-1} V) is the correction "
                                    "warpgroup's"),
    )),
    (("sm90",), ("matmul",), ("promote_every=0",), (
        Claim("mma", 0.5, "each K step's wgmma in flight while the next one issues "
                          "(promote_every=0, delay_release=1)"),
    )),
)


def claims_for(row: dict) -> tuple[Claim, ...]:
    """The claims of a report row's kernel: every claim is a Mosaic kernel's (a Mosaic impl's
    backward at head_dim 256 runs the Triton grid kernels, which claim nothing)."""
    if row.get("backend", "mosaic") != "mosaic":
        return ()
    text = f"{row.get('variant', '')} {row.get('config', '')}"
    return tuple(c for impls, passes, needs, claims in OVERLAP_CLAIMS
                 if row.get("impl") in impls and row.get("pass") in passes
                 and all(n in text for n in needs) for c in claims
                 if not c.head_dims or row.get("head_dim") in c.head_dims)


def claim_holds(audit: dict, claim: Claim) -> bool:
    if claim.unit == "softmax_waits":
        return (audit.get("softmax") or {}).get("waits_after_ex2", 1) == 0
    loop = audit.get("mma") or {}
    if claim.unit == "a_tmem":
        total = loop.get("counts", {}).get("mma", 0)
        return total > 0 and loop.get("a_tmem", 0) >= claim.min_fraction * total
    total = loop.get("counts", {}).get(claim.unit, 0)
    over = loop.get("overlapped", {}).get(claim.unit, 0)
    return total > 0 and over >= claim.min_fraction * total


def check_claims(audit: dict, claims) -> list[str]:
    """One line per claim whose status differs from what is declared: missing from the SASS,
    or (a known gap) present after all; [] when all are as declared."""
    out = []
    for c in claims:
        holds = claim_holds(audit, c)
        if not holds and not c.known_gap:
            out.append(f"claimed overlap missing: {c.what} ({_fraction(audit, c)})")
        elif holds and c.known_gap:
            out.append(f"known gap closed (update OVERLAP_CLAIMS): {c.what} "
                       f"({_fraction(audit, c)})")
    return out


def _fraction(audit: dict, c: Claim) -> str:
    loop = audit.get("mma") or {}
    if c.unit == "softmax_waits":
        waits = (audit.get("softmax") or {}).get("waits_after_ex2", "no softmax loop: ?")
        return f"{waits} mbarrier waits after the softmax loop's first exp2, claimed 0"
    if c.unit == "a_tmem":
        return (f"{loop.get('a_tmem', 0)} of {loop.get('counts', {}).get('mma', 0)} MMAs "
                f"with A in TMEM, claimed >= {c.min_fraction:.0%}")
    return (f"{loop.get('overlapped', {}).get(c.unit, 0)} of "
            f"{loop.get('counts', {}).get(c.unit, 0)} {c.unit} in a window, "
            f"claimed >= {c.min_fraction:.0%}")


def claim_status(audit: dict, claims) -> str:
    """The table's cell: each claim's unit and whether the SASS shows it."""
    if not claims:
        return "none"
    cells = []
    for c in claims:
        holds = claim_holds(audit, c)
        state = "holds" if holds else "missing (known)" if c.known_gap else "**MISSING**"
        cells.append(f"{c.unit}: {state}")
    return "; ".join(cells)


def annotate(row: dict) -> dict:
    """A worker row with its SASS audit (`sass`) -> plus `claims` (the cell) and
    `claim_problems` (check_claims' lines)."""
    audit = row.get("sass")
    if not audit or "error" in audit:
        return row
    claims = claims_for(row)
    return dict(row, claims=claim_status(audit, claims),
                claim_problems=check_claims(audit, claims))


def problems(rows: list[dict]) -> list[str]:
    """One line per kernel whose SASS audit failed, whose declared overlaps are not as
    declared, or whose warpgroup waits before giving registers back; [] when all are."""
    out = []
    for r in rows:
        label = f"{r['gpu']} {r['impl']} {r['pass']} hd{r.get('head_dim')} {r['variant']}"
        if "sass" in r and "error" in r["sass"]:
            out.append(f"{label}: SASS audit: {r['sass']['error']}")
        out += [f"{label}: {p}" for p in r.get("sass", {}).get("register_order", ())]
        out += [f"{label}: {p}" for p in r.get("claim_problems", ())]
    return out


# --- the table -----------------------------------------------------------------------------------

BEGIN, END = "<!-- sass-audit:begin -->", "<!-- sass-audit:end -->"
SASS_COLUMNS = ("gpu", "impl", "pass", "hd", "variant", "MMA per tile", "EX2", "FP32", "ALU",
                "SMEM", "instr", "schedule", "in a wgmma window", "bound clk (unit)", "claims")


def _row_cells(r: dict) -> list[str]:
    a = r["sass"]
    base = [r["gpu"], r["impl"], r["pass"], str(r.get("head_dim") or ""), r["variant"]]
    if "error" in a:
        return base + [f"**{a['error']}**"] + [""] * (len(SASS_COLUMNS) - len(base) - 1)
    mma, work = a["mma"], a.get("softmax") or a["mma"]
    c = work["counts"]
    sched = mma["schedule"] if "softmax" not in a else \
        f"MMA warp: {mma['schedule']}; softmax: {a['softmax']['schedule']}"
    if "overlapped" in mma:
        ov = mma["overlapped"]
        window = (f"{ov['ex2']}/{mma['counts']['ex2']} EX2, "
                  f"{ov['mma']}/{mma['counts']['mma']} MMA")
    elif "UTC" in mma["mma_kinds"]:
        window = "n/a (tcgen05: mbarriers)"
    else:
        window = "n/a (mma.sync)"
    b = a["bound"]
    tensor = "?" if b["tensor"] is None else b["tensor"]  # a UTC*MMA's shape not in the SASS
    bound = f"{b['bound']} ({b['limiter']}{'' if b['limiter'] == 'tensor' else f'; tensor {tensor}'})"
    return base + [mma["mma_kinds"], str(c["ex2"]), str(c["fp32"]), str(c["alu"]),
                   str(c["smem"]), str(c["total"]), f"`{sched}`", window, bound,
                   r.get("claims", "none")]


def markdown_table(rows: list[dict]) -> str:
    """One line per kernel row that has a SASS audit."""
    lines = ["| " + " | ".join(SASS_COLUMNS) + " |", "|" + "|".join("---" for _ in SASS_COLUMNS)
             + "|"]
    lines += ["| " + " | ".join(x.replace("|", "\\|") for x in _row_cells(r)) + " |"
              for r in rows if "sass" in r]
    return "\n".join(lines)


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
