"""SASS as data (part of the SASS audit, titanax.perf.sass_audit): nvdisasm's `-c` text parsed
into functions of instructions and labels, each instruction's class (matmul, exp2, FP32, ALU,
shared memory, ...), and the natural loops of a function's control-flow graph.

How a loop is found: the function's control-flow graph (basic blocks split at labels and
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
"""

from __future__ import annotations

import dataclasses
import re

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
