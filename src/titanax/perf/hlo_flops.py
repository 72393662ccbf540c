"""The matrix multiplies of a compiled (optimized) HLO module, counted from its text: every GEMM
and attention call the program runs, what runs it, its FLOPs and how often it runs per step.

XLA's cost_analysis() is None for a deviceless GPU compile, so the FLOPs come from the shapes:
- a dot (or a GEMM custom call with its dot_dimension_numbers): 2 * prod(result dims) *
  prod(lhs contracting dims), the result being batch x M x N;
- an attention call: one unit is 2*B*Hq*S*T*D (one S x T matmul); a forward runs 2 units
  (Q K^T, P V), a backward 2 + one per gradient it returns (it recomputes S = Q K^T and
  dP = dO V^T, then dQ, dK, dV): 5 for cuDNN's fused backward (2.5x the forward, as
  FlashAttention-2), 3 + 4 for a split dq / dkv kernel pair; halved when causal. cuDNN says
  B, Hq, S, T and its mask in backend_config; our kernels' q / k operands ([B, S, H, D]) give
  the shapes, and whether the call is causal is not in the text: the caller says (`causal`).
Executions per step: the product of the trip counts of the while loops around the instruction
(backend_config known_trip_count, else the constant the loop condition compares with), through
nested loops (layer scan, gradient accumulation, pipeline ticks); a conditional counts its most
expensive branch (an upper bound).

Kinds, by what runs the multiply: cuBLAS / cuBLASLt custom calls, cuDNN (fused attention
`__cudnn$fmha*`, cuDNN GEMM fusions), Triton GEMM fusions, CUTLASS custom fusions, our Pallas
kernels (Mosaic GPU `mosaic_gpu*`, Pallas Triton `__gpu$xla.gpu.triton`, jax-triton), and
XLA's own emitters: a dot inside a loop / input fusion (kind=kLoop/kInput, e.g. `wrapped_dot`)
or a bare dot, which run on CUDA cores without tensor-core tiling (`library` False).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from titanax.perf.hlo_text import Instr, arrays, tuple_element

# cuDNN's fused-attention mask types that apply the causal mask themselves (no dense operand).
CAUSAL_MASKS = ("CAUSAL", "PADDING_CAUSAL", "CAUSAL_BOTTOM_RIGHT", "PADDING_CAUSAL_BOTTOM_RIGHT")
KERNEL_TARGETS = {"mosaic_gpu": "Mosaic GPU kernel", "mosaic_gpu_v2": "Mosaic GPU kernel",
                  "__gpu$xla.gpu.triton": "Pallas Triton kernel",
                  "triton_kernel_call": "jax-triton kernel"}
_DOTS = ("dot", "scaled-dot")


@dataclasses.dataclass
class Matmul:
    """One instruction that multiplies matrices (per device)."""
    name: str           # the HLO instruction (a fusion, custom call or dot)
    category: str       # 'gemm' or 'attention'
    kind: str           # what runs it: 'cuBLASLt', 'Triton GEMM', 'cuDNN fMHA', 'kLoop fusion', ...
    flops: float        # one execution
    count: int          # executions per step
    shape: str          # the result, e.g. 'bf16[8,1024,4096]'
    where: str          # the Python source line (jax's stack frame), '' when unknown
    library: bool       # a library, Triton or kernel call (False: XLA's loop emitter)
    detail: dict = dataclasses.field(default_factory=dict)  # attention: direction, mask, ...

    @property
    def total(self) -> float:
        return self.flops * self.count


def _prod(dims) -> int:
    return math.prod(int(d) for d in dims)


def shape_text(shape: str) -> str:
    dt, dims = (arrays(shape) or [("?", ())])[0]
    return f"{dt}[{','.join(map(str, dims))}]"


def operand_arrays(ins: Instr, shapes: dict[str, str]) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, dims) of each operand (the first array of a tuple-shaped one; %x#k: its
    element k); ('?', ()) where the shape is unknown."""
    out = []
    for name, index in ins.operand_refs:
        shape = shapes.get(name, "")
        found = arrays(tuple_element(shape, index) if index is not None else shape)
        out.append(found[0] if found else ("?", ()))
    return out


def dot_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """2 * prod(result) * prod(lhs contracting dims) of a dot / scaled-dot."""
    lhs = (operand_arrays(ins, shapes) or [("?", ())])[0][1]
    contract = ins.attr(r"lhs_contracting_dims=\{([\d,]*)\}") or ""
    k = _prod(lhs[int(c)] for c in contract.split(",") if c and int(c) < len(lhs))
    return 2.0 * _prod(ins.arrays[0][1]) * k


def gemm_call_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """A library GEMM custom call: its dot_dimension_numbers over operand 0 and result 0
    (without them: the lhs's last dim is K)."""
    lhs = (operand_arrays(ins, shapes) or [("?", ())])[0][1]
    m = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', ins.rest)
    contract = [int(c) for c in re.findall(r"\d+", m.group(1))] if m else [len(lhs) - 1]
    return 2.0 * _prod(ins.arrays[0][1]) * _prod(lhs[c] for c in contract if c < len(lhs))


def trip_count(ins: Instr, comps: dict[str, list[Instr]]) -> tuple[int, str]:
    """(iterations, how it is known) of a while loop: known_trip_count, else the one integer
    constant its condition (or a fusion in it) compares with, else (1, 'unknown')."""
    n = ins.attr(r'"known_trip_count":\s*\{\s*"n":\s*"(\d+)"')
    if n is not None:
        return int(n), "known_trip_count"
    cond = ins.attr(r"\bcondition=%([\w.\-]+)")
    todo, consts = [cond], set()
    while todo:
        for i in comps.get(todo.pop(), ()):
            if i.opcode == "constant" and re.match(r"[su]\d+\[\]", i.shape):
                consts.add(int(re.match(r"(-?\d+)", i.rest).group(1)))
            elif i.opcode == "fusion":
                todo.append(i.fusion_body)
    consts.discard(0)
    if len(consts) == 1 and next(iter(consts)) > 0:
        return next(iter(consts)), "condition constant"
    return 1, "unknown"


def _cudnn_attention(ins: Instr, shapes: dict[str, str], where: str, count: int) -> Matmul:
    target = ins.attr(r'custom_call_target="([^"]+)"')
    mask = ins.attr(r'"mask_type":\s*"(\w+)"') or "?"
    operand_dims = [d for _, d in operand_arrays(ins, shapes)]
    # the scores' [B, H, S, T]; else from q [B, S, H, D] and k [B, T, Hkv, D]
    dims = ins.attr(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
    dims = [int(x) for x in re.findall(r"\d+", dims or "")]
    if len(dims) == 4:
        b, h, s, t = dims
    else:
        q, k = (operand_dims + [(0,) * 4] * 2)[:2]
        b, s, h, t = q[0], q[1], q[2], k[1]
    outs = [d for _, d in ins.arrays if len(d) == 4 and d[-2:] != (s, t)]  # not a bias grad
    head_dim = outs[0][-1] if outs else 0
    backward = "Backward" in target
    units = 2 + len(outs) if backward else 2   # recompute S, dP; one matmul per gradient
    causal = mask in CAUSAL_MASKS
    dense = [o for o, d in zip(ins.operands, operand_dims) if len(d) >= 2 and d[-2:] == (s, t)]
    flops = units * 2.0 * b * h * s * t * head_dim * (0.5 if causal else 1.0)
    detail = {"direction": "backward" if backward else "forward", "mask_type": mask,
              "causal": causal, "dense_mask": "Bias" in target or bool(dense),
              "mask_operands": dense, "target": target, "B_H_S_T_D": [b, h, s, t, head_dim]}
    return Matmul(ins.name, "attention", "cuDNN fMHA", flops, count, shape_text(ins.shape),
                  where, True, detail)


def _kernel_call(ins: Instr, shapes: dict[str, str], where: str, count: int,
                 causal: bool) -> Matmul:
    """One of our Pallas kernels (or any Mosaic / Triton custom call): attention or GEMM,
    told by its name, its source file, else its shapes (3+ rank-4 operands: q, k, v)."""
    target = ins.attr(r'custom_call_target="([^"]+)"')
    kind = KERNEL_TARGETS.get(target, target)
    text = f"{ins.op_name} {where}"
    ops = [a for a in operand_arrays(ins, shapes) if a[1]]
    four = [d for _, d in ops if len(d) == 4]
    if re.search(r"fp8|matmul", where):         # pallas_kernels/fp8/matmul_*.py
        attention = False
    elif re.search(r"flash|attention|context\.py", text):
        attention = True
    else:
        attention = len(four) >= 3 and len({d[-1] for d in four[:3]}) == 1
    out = ins.arrays
    if not attention:
        lhs = ops[0][1] if ops else (1,)
        flops = 2.0 * _prod(out[0][1]) * (lhs[-1] if lhs else 1)
        return Matmul(ins.name, "gemm", kind, flops, count, shape_text(ins.shape), where, True)
    q, k = (four + [(), ()])[:2]
    kv_len = max(k[1], k[2]) if len(k) == 4 else 0
    backward = len(four) > 3
    units = 2 + sum(len(d) == 4 for _, d in out) if backward else 2
    flops = units * 2.0 * _prod(q) * kv_len * (0.5 if causal else 1.0)
    detail = {"direction": "backward" if backward else "forward", "mask_type": "in kernel",
              "causal": causal, "dense_mask": False, "causal_assumed": True, "target": target}
    return Matmul(ins.name, "attention", kind, flops, count, shape_text(ins.shape), where,
                  True, detail)


def _fusion_kind(ins: Instr) -> tuple[str, bool]:
    """(kind label, runs in a library / Triton) of a fusion."""
    kind = ins.attr(r'"kind":\s*"(__[\w$]+)"')
    if kind is None:
        fusion = ins.attr(r"\bkind=(k[A-Za-z]+)") or "k?"
        if fusion != "kCustom":  # kLoop / kInput / kOutput: XLA's own loop emitters
            return f"{fusion} fusion", False
        # kCustom runs a custom emitter, never the loop emitter; XLA's GemmFusion pass names
        # its Triton GEMMs gemm_fusion_* (seen without a backend config after loop unrolling)
        gemm = re.match(r"gemm_fusion", ins.fusion_body or "")
        return ("Triton GEMM" if gemm else "kCustom fusion"), True
    if kind.startswith("__triton"):
        return "Triton GEMM", True
    if kind.startswith("__cudnn"):
        return "cuDNN fusion", True
    if kind.startswith("__cublas"):
        return "cuBLAS", True
    if kind == "__custom_fusion":  # CUTLASS: custom_fusion_config names the kernel
        name = ins.attr(r'"name":\s*"([^"]+)"') or "?"
        return f"custom fusion ({name})", True
    return f"fusion {kind}", True


def _gemm_kind(target: str) -> str:
    if target.startswith("__cublas$lt"):
        return "cuBLASLt" + (" f8" if target.endswith("f8") else "")
    if target.startswith("__cudnn$"):
        return f"cuDNN {target.removeprefix('__cudnn$')}"
    return "cuBLAS" if target.startswith("__cublas") else target


class Counter:
    """Walks the program's control flow from ENTRY and collects its Matmuls."""

    def __init__(self, comps: dict[str, list[Instr]], frames: dict[int, str], *, causal: bool,
                 square: Callable[[tuple[int, ...], str], bool] = lambda dims, where: False):
        """square(dims, where): whether an array of these dims made at that source line is
        S x S (a dot with such an operand or result is attention done by XLA's dots)."""
        self.comps, self.frames, self.causal, self.square = comps, frames, causal, square
        self.shapes = {i.name: i.shape for body in comps.values() for i in body}
        self.loops: list[dict] = []
        self._fused: dict[str, tuple[float, bool]] = {}

    def fused_dots(self, comp: str) -> tuple[float, bool]:
        """(FLOPs of the dots in a fusion body, nested fusions included; whether a dot has an
        S x S operand or result)."""
        if comp not in self._fused:
            flops, square = 0.0, False
            for ins in self.comps.get(comp, ()):
                if ins.opcode in _DOTS:
                    flops += dot_flops(ins, self.shapes)
                    square |= self._square_dot(ins)
                elif ins.opcode == "fusion":
                    f, s = self.fused_dots(ins.fusion_body)
                    flops, square = flops + f, square or s
            self._fused[comp] = (flops, square)
        return self._fused[comp]

    def _square_dot(self, ins: Instr) -> bool:
        where = self.frames.get(ins.stack_frame, "")
        dims = [ins.arrays[0][1], *(d for _, d in operand_arrays(ins, self.shapes)[:1])]
        return any(self.square(d, where) for d in dims)

    def _fused_calls(self, comp: str) -> list[Instr]:
        """The custom calls inside a fusion body, nested fusions included."""
        out = []
        for ins in self.comps.get(comp, ()):
            if ins.opcode == "custom-call":
                out.append(ins)
            elif ins.opcode == "fusion":
                out += self._fused_calls(ins.fusion_body)
        return out

    def walk(self, comp: str, count: int = 1) -> list[Matmul]:
        out: list[Matmul] = []
        for ins in self.comps.get(comp, ()):
            out += self._instr(ins, count)
        return out

    def _instr(self, ins: Instr, count: int) -> list[Matmul]:
        op = ins.opcode
        if op == "while":
            trip, how = trip_count(ins, self.comps)
            self.loops.append({"name": ins.name, "trip_count": trip, "from": how,
                               "executions": count, "where": self.frames.get(ins.stack_frame, "")})
            return self.walk(ins.attr(r"\bbody=%([\w.\-]+)"), count * trip)
        if op == "conditional":
            branches = [self.walk(c, count) for c in ins.called()]
            return max(branches, key=lambda b: sum(m.total for m in b), default=[])
        if op in ("call", "async-start"):
            called = ins.attr(r"\b(?:to_apply|calls)=%([\w.\-]+)")
            return self.walk(called, count)
        where = self.frames.get(ins.stack_frame, "")
        if op in ("fusion", "fusion-start"):
            # library calls a fusion wraps (XLA's dynamic-slice fusion around a cuBLAS call)
            calls = [m for i in self._fused_calls(ins.fusion_body) for m in self._instr(i, count)]
            flops, square = self.fused_dots(ins.fusion_body)
            if not flops:
                return calls
            kind, library = _fusion_kind(ins)
            return calls + [self._gemm(ins, kind, flops, count, where, library, square)]
        if op in _DOTS:
            return [self._gemm(ins, "bare dot", dot_flops(ins, self.shapes), count, where, False,
                               self._square_dot(ins))]
        if op != "custom-call":
            return []
        target = ins.attr(r'custom_call_target="([^"]+)"') or ""
        if target.startswith("__cudnn$fmha"):
            return [_cudnn_attention(ins, self.shapes, where, count)]
        if target in KERNEL_TARGETS:
            return [_kernel_call(ins, self.shapes, where, count, self.causal)]
        # __cublas$gemm, __cublas$lt$matmul[$f8], __cudnn$blockScaledDot (MXFP8), ...; not
        # cuDNN convolutions / norms or cuBLAS's triangular solve
        if re.search(r"(?i)gemm|matmul|dot", target):
            return [self._gemm(ins, _gemm_kind(target), gemm_call_flops(ins, self.shapes), count,
                               where, True, False)]
        return []

    def _gemm(self, ins: Instr, kind: str, flops: float, count: int, where: str,
              library: bool, square: bool) -> Matmul:
        """A GEMM; one with an S x S operand or result is attention done by XLA's dots."""
        if square:  # (autodiff's backward ops carry transpose(...) in their op_name)
            direction = "backward" if "transpose(" in ins.op_name else "forward"
            return Matmul(ins.name, "attention", f"XLA dots ({kind})", flops, count,
                          shape_text(ins.shape), where, library,
                          {"direction": direction, "mask_type": "dense (XLA)", "causal": False,
                           "dense_mask": True})
        return Matmul(ins.name, "gemm", kind, flops, count, shape_text(ins.shape), where,
                      library)
