"""The static cost of SASS (part of the SASS audit, titanax.perf.sass_audit): each matmul
instruction's shape and a cycle bound per tile from one loop iteration's instruction counts.

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

import re

from titanax.perf.sass_parse import MMA_BLACKWELL, MMA_WARP, Function, Instr, classify, counts

# --- matmul shapes and the cost table -----------------------------------------------------------

_PAIRED = {"FFMA2", "FMUL2", "FADD2"}  # Blackwell's paired FP32 instructions: two per lane

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
