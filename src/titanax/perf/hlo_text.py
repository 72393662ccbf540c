"""Reading compiled (scheduled) HLO text: its computations, their instructions in schedule
order, the computations control flow runs (while bodies, conditional branches, calls), and the
mesh axes a collective communicates over.

What perf/tp_overlap.py and the compiled-step audit (plan/audit.py, perf/hlo_flops.py) need,
from `compiled.as_text()`; no XLA bindings, so a saved HLO file can be read anywhere. Device ids in replica groups and source-target pairs are positions
in the mesh's device array (SPMD with use_global_device_ids), row-major over its axes.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
               "collective-permute")

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_CALLED = re.compile(r"\b(body|condition|true_computation|false_computation|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    opcode: str
    shape: str
    rest: str  # operands and attributes, as printed

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.rest.split(")", 1)[0])

    @property
    def operand_refs(self) -> list[tuple[str, int | None]]:
        """(name, tuple index) per operand: newer HLO text writes an element of a tuple-shaped
        value as %name#k (an implicit get-tuple-element)."""
        return [(n, int(k) if k else None)
                for n, k in re.findall(r"%([\w.\-]+)(?:#(\d+))?", self.rest.split(")", 1)[0])]

    def called(self) -> list[str]:
        """Computations this instruction runs as control flow (not fusion bodies or
        reducers)."""
        if self.opcode == "while":
            return [n for k, n in _CALLED.findall(self.rest) if k in ("body", "condition")]
        if self.opcode == "conditional":
            names = [n for k, n in _CALLED.findall(self.rest) if k.endswith("_computation")]
            for group in _BRANCHES.findall(self.rest):
                names += re.findall(r"%([\w.\-]+)", group)
            return names
        if self.opcode == "call":
            return [n for k, n in _CALLED.findall(self.rest) if k == "to_apply"]
        return []

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(element type, dims) of each array in this instruction's (maybe tuple) shape."""
        return arrays(self.shape)

    def attr(self, pattern: str) -> str | None:
        """The first group of `pattern` searched in the operands and attributes, or None."""
        m = re.search(pattern, self.rest)
        return m.group(1) if m else None

    @property
    def fusion_body(self) -> str | None:
        """The computation a fusion (or async-start) instruction runs: its calls=."""
        return self.attr(r"\bcalls=%([\w.\-]+)")

    @property
    def stack_frame(self) -> int:
        """The metadata's stack_frame_id (0: none); stack_frames() resolves it."""
        return int(self.attr(r"\bstack_frame_id=(\d+)") or 0)

    @property
    def op_name(self) -> str:
        """The metadata's op_name (jax's name stack), unescaped."""
        name = self.attr(r'\bop_name="((?:[^"\\]|\\.)*)"') or ""
        return re.sub(r"\\(.)", r"\1", name)

    @property
    def is_gemm(self) -> bool:
        """A matrix multiply as XLA:GPU emits it: a (Triton) GEMM fusion, maybe launched
        async on another compute stream, a cuBLAS/cuBLASLt custom call, or a plain dot."""
        if self.opcode == "dot":
            return True
        if self.opcode in ("fusion", "fusion-start"):
            return bool(re.search(r"calls=%gemm_fusion|\"kind\":\"__(triton_gemm|cublas)",
                                  self.rest))
        if self.opcode == "custom-call":
            return bool(re.search(r'custom_call_target="__cublas', self.rest))
        return False

    @property
    def collective(self) -> str | None:
        """The collective this instruction starts or runs (sync), else None."""
        op = self.opcode.removesuffix("-start")
        return op if op in COLLECTIVES else None

    @property
    def is_async_start(self) -> bool:
        return self.opcode.endswith("-start")


def computations(hlo_text: str) -> dict[str, list[Instr]]:
    """{computation name: its instructions in printed (for scheduled HLO: schedule) order}."""
    comps: dict[str, list[Instr]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = comps.setdefault(header.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line) if current is not None else None
        if m:
            current.append(Instr(m.group(1), m.group(3), m.group(2), m.group(4)))
    return comps


def entry_name(hlo_text: str) -> str:
    """The name of the module's ENTRY computation."""
    return re.search(r"^ENTRY %([\w.\-]+)", hlo_text, re.M).group(1)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """'(bf16[4,8]{1,0}, f32[])' -> [('bf16', (4, 8)), ('f32', ())]."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(shape)]


def tuple_element(shape: str, index: int) -> str:
    """The shape of element `index` of a tuple shape (nested tuples stay whole)."""
    if not shape.startswith("("):
        return shape
    depth, start, parts = 0, 1, []
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                parts.append(shape[start:i])
                break
        elif ch == "," and depth == 1:
            parts.append(shape[start:i])
            start = i + 1
    parts = [re.sub(r"^\s*(/\*index=\d+\*/)?", "", p) for p in parts]
    return parts[index] if index < len(parts) else ""


def stack_frames(hlo_text: str) -> dict[int, str]:
    """{stack_frame_id: 'folder/file.py:line (function)'}, the innermost Python frame each id
    names, from the FileNames / FunctionNames / FileLocations / StackFrames tables that HLO text
    starts with (jax's source information; {} when the module has none)."""
    end = hlo_text.find("\nENTRY ")
    head = hlo_text[:end] if end > 0 else ""

    def table(title: str) -> dict[int, str]:
        m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", head, re.S | re.M)
        rows = (r.split(" ", 1) for r in (m.group(1).splitlines() if m else []))
        return {int(r[0]): r[1].strip('"') for r in rows if len(r) == 2 and r[0].isdigit()}

    def ids(text: str) -> dict[str, int]:
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}

    files, funcs = table("FileNames"), table("FunctionNames")
    where = {}
    for i, loc in table("FileLocations").items():
        loc = ids(loc)
        path = "/".join(files.get(loc.get("file_name_id"), "?").split("/")[-2:])
        where[i] = f"{path}:{loc.get('line', '?')} ({funcs.get(loc.get('function_name_id'), '?')})"
    return {i: where.get(ids(f).get("file_location_id"), "")
            for i, f in table("StackFrames").items()}


def reachable(comps: dict[str, list[Instr]], root: str, into_loops: bool = True) -> list[str]:
    """root and every computation its control flow runs, transitively (into_loops=False: not
    into the bodies of nested while loops, which are loops of their own)."""
    seen, todo = [], [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.append(name)
        for ins in comps[name]:
            if into_loops or ins.opcode != "while":
                todo += ins.called()
    return seen


# --- which mesh axes a collective spans ------------------------------------------------------

def _iota_groups(spec: str) -> list[list[int]]:
    """'[G,S]<=[d0,d1,...]T(p...)' -> G groups of S device ids."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape[0], -1).tolist()


def _mesh_groups(spec: str) -> list[list[int]]:
    """"mesh['a'=2,'b'=4] {'b'}" -> groups varying over the named axes (row-major ids)."""
    sizes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", spec.split("]", 1)[0])]
    chosen = set(re.findall(r"'(\w+)'", spec.split("]", 1)[1]))
    ids = np.arange(int(np.prod([n for _, n in sizes]))).reshape([n for _, n in sizes])
    keep = [i for i, (a, _) in enumerate(sizes) if a not in chosen]
    vary = [i for i, (a, _) in enumerate(sizes) if a in chosen]
    return ids.transpose(keep + vary).reshape(-1, int(np.prod(
        [sizes[i][1] for i in vary]) if vary else 1)).tolist()


def device_groups(ins: Instr) -> list[list[int]] | None:
    """The device groups of a collective (pairs for collective-permute), None when the text
    gives none (all devices)."""
    if ins.collective == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", ins.rest)
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")] \
            if pairs else []
    m = re.search(r"replica_groups=(\{\{.*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                  r"|mesh\[[^\]]*\] \{[^}]*\})", ins.rest)
    if m is None or m.group(1) == "{}":
        return None
    spec = m.group(1)
    if spec.startswith("{{"):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", spec)]
    return _mesh_groups(spec) if spec.startswith("mesh") else _iota_groups(spec)


def collective_dtypes(hlo_text: str) -> dict[str, dict[str, int]]:
    """{collective: {element type: instructions carrying it}} in compiled HLO text, e.g. which
    dtype FSDP reduce-scatters gradients in (execution.grad_reduce_dtype). A combined collective
    (the GPU flags' combiners) is one instruction over a tuple of arrays, maybe of several
    types, with /*index=5*/ comments in its shape."""
    out: dict[str, dict[str, int]] = {}
    pattern = (r"= (\(*\w+\[[^\n]*?) (all-gather|all-reduce|reduce-scatter|"
               r"collective-permute|all-to-all)(?:-start)?\(")
    for shape, op in re.findall(pattern, hlo_text):
        for dtype in dict.fromkeys(re.findall(r"(\w+)\[", shape)):
            out.setdefault(op, {}).setdefault(dtype, 0)
            out[op][dtype] += 1
    return out


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def largest_array_bytes(shape: str) -> int:
    """The largest array in an instruction's (maybe tuple) shape, in bytes: a collective's
    full-size side (an all-gather's output, a reduce-scatter's input)."""
    sizes = [_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape)]
    return max(sizes, default=0)


def wire_bytes(ins: Instr) -> float:
    """Bytes one device sends for this collective with ring algorithms: (n-1)/n of the full
    array for all-gather, reduce-scatter and all-to-all, twice that for all-reduce, the
    array itself for a collective-permute (n: devices per group)."""
    full = largest_array_bytes(ins.shape)
    if ins.collective == "collective-permute":
        return float(full)
    groups = device_groups(ins)
    n = len(groups[0]) if groups else 1
    share = (n - 1) / n if n > 1 else 0.0
    return full * share * (2 if ins.collective == "all-reduce" else 1)


def collective_axes(ins: Instr, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (of mesh_shape, ordered as the mesh) along which the devices of one
    group or pair of this collective differ; () for a no-op (every device alone)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    groups = device_groups(ins)
    if groups is None:
        return tuple(a for a, n in mesh_shape.items() if n > 1)
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(group, sizes)).T
        varying |= {names[i] for i in np.nonzero((coords != coords[0]).any(axis=0))[0]}
    return tuple(a for a in names if a in varying)
