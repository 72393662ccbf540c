"""The buffers live at the peak of a compiled program's memory, largest first, and what made them.

memory_analysis() only gives totals (the GPU's temporaries are one preallocated block), and its
serialized buffer-assignment proto is empty for GPU executables, so this reads XLA's own dump of
the optimized module instead (compile with compiler_options={"xla_dump_to": DIR}):
- `*after_optimizations-buffer-assignment.txt`: every allocation and the HLO values placed in it,
  with size, offset and shape;
- `*after_optimizations-live-range.txt`: each value's live range [start, end] (both inclusive, the
  heap simulator's convention) over the module's flattened instruction sequence, so a scanned
  layer body or a cond branch counts once;
- `*after_optimizations.txt`: the optimized HLO, for each instruction's opcode, JAX op_name and
  source line (the stack-frame tables at its top).
The live-range file has its own "Live ranges at N (peak)" section, but it sums values that share
memory (a donated parameter, its in-place update and the cond's phi are three values in one
buffer), so it overstates the peak (317 GB for a 221 GB step); the peak here is the union of the
byte ranges live at each time within each allocation.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import tempfile

# Allocations whose memory is not the program's own working set on the device: the caller holds
# the parameters for the whole step, constants are baked in, thread-local ones are registers,
# and "host" ones (a memory color other than 0: pinned host memory, S(5) in the layouts, where
# host offload puts saved activations and optimizer state) are not in HBM at all.
_NOT_HEAP = ("parameter", "constant", "thread-local", "host")


@dataclasses.dataclass
class Value:
    """An HLO value placed in an allocation: `name{index}` as the dumps write it."""
    id: int
    name: str           # defining instruction
    index: str          # shape index, "{}" for a non-tuple value
    phi: bool           # a merge of loop/cond values, defined by no instruction of its own
    size: int
    offset: int
    shape: str
    allocation: int
    live: tuple[int, int] | None = None   # [start, end] in the instruction sequence

    @property
    def key(self) -> str:
        return self.name + self.index


@dataclasses.dataclass
class Allocation:
    index: int
    size: int
    kind: str           # parameter, constant, thread-local, temp, output
    parameter: int | None
    values: list[Value]


@dataclasses.dataclass
class Instruction:
    name: str
    computation: str
    opcode: str         # with the fusion kind or custom-call target where there is one
    op_name: str
    source: str         # file:line (function), '' when the metadata has none
    operands: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()     # computations it runs: loop body, cond branches, fusion
    hint: str = ""      # for an instruction XLA made up (no op_name): where it comes from


# ---------------------------------------------------------------------------------------------
# parsers, one per dump file

_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <(\d+) (\S+?)(\{[\d,]*\})?( \(phi\))?(?: @\d+)?> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)$")


def parse_buffer_assignment(text: str) -> list[Allocation]:
    allocations = []
    for line in text.splitlines():
        if m := _ALLOC.match(line):
            attrs = m.group(3)
            param = re.search(r"\bparameter (\d+)", attrs)
            color = re.search(r"\bcolor (\d+)", attrs)
            kind = ("parameter" if param else
                    "host" if color and color.group(1) != "0" else "constant" if ", constant" in attrs else
                    "thread-local" if "thread-local" in attrs else
                    "temp" if "preallocated-temp" in attrs else
                    "output" if "maybe-live-out" in attrs else "temp")
            allocations.append(Allocation(int(m.group(1)), int(m.group(2)), kind,
                                          int(param.group(1)) if param else None, []))
        elif (m := _VALUE.match(line)) and allocations:
            vid, name, index, phi, size, offset, shape = m.groups()
            allocations[-1].values.append(Value(
                int(vid), name, index or "{}", bool(phi), int(size), int(offset),
                shape.strip(), allocations[-1].index))
    if not allocations:
        raise ValueError("no 'allocation N: size ...' lines: not an XLA buffer-assignment dump")
    return allocations


def parse_live_ranges(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """(instruction sequence, {'name{index}': (start, end)}) from a live-range dump."""
    sequence, ranges, section = [], {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped in ("InstructionSequence:", "BufferLiveRange:"):
            section = stripped
        elif not line.startswith("    "):
            section = None      # 'Live ranges at N (peak):' and what follows: not used
        elif section == "InstructionSequence:":
            sequence.append(stripped.split(":", 1)[1])
        elif section == "BufferLiveRange:":
            if m := re.match(r"(\S+\{[\d,]*\}):(\d+)-(\d+)$", stripped):
                ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return sequence, ranges


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$")


def _opcode(rhs: str) -> tuple[str, tuple[str, ...]]:
    """'f32[2]{0} fusion(%a), kind=kLoop, ...' -> ('fusion kLoop', ('a',)); tuple shapes nest
    parens."""
    i, depth = 0, 0
    if rhs.startswith("("):
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
    m = re.match(r"[^ ]*\s+([\w\-]+)\(([^)]*)\)", rhs[i:])
    op = m.group(1) if m else "?"
    if extra := re.search(r"\bkind=(k\w+)|custom_call_target=\"([^\"]+)\"", rhs):
        op += " " + (extra.group(1) or extra.group(2))
    return op, tuple(re.findall(r"%([\w.\-]+)", m.group(2))) if m else ()


def _source_tables(text: str) -> dict[int, str]:
    """stack_frame_id -> 'file:line (function)' from the FileNames / FunctionNames /
    FileLocations / StackFrames tables newer XLA prints at the top of a module. A frame inside
    a library (optax, flax) also names the innermost frame of our own code that called it."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in text.splitlines():
        if line.startswith("%") or line.startswith("ENTRY"):
            break
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line, {})
        elif section is not None and (m := re.match(r"(\d+) (.*)$", line)):
            section[int(m.group(1))] = m.group(2)
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locs = {}
    for i, body in tables.get("FileLocations", {}).items():
        f = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", body)}
        path = files.get(f.get("file_name_id", 0), "?").strip('"')
        func = funcs.get(f.get("function_name_id", 0), "?").strip('"')
        locs[i] = (f"{_short_path(path)}:{f.get('line', '?')} ({func})",
                   "site-packages" in path or path.startswith("<"))
    frames = {}
    for i, body in tables.get("StackFrames", {}).items():
        f = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", body)}
        frames[i] = (f.get("file_location_id", 0), f.get("parent_frame_id", 0))
    # XLA 0.11 prints parent_frame_id one too high (the root frame names itself as parent);
    # a frame can never be its own parent, so that is how the shift is recognised
    shift = 1 if any(parent == i for i, (_, parent) in frames.items()) else 0
    out = {}
    for i, (loc, _) in frames.items():
        text_, library = locs.get(loc, ("", False))
        j, seen = i, set()
        while library and j in frames and j not in seen:    # up to our own code
            seen.add(j)
            j = frames[j][1] - shift
            caller, library = locs.get(frames[j][0], ("", False)) if j in frames else ("", False)
            if caller and not library:
                text_ += f" <- {caller}"
        out[i] = text_
    return out


def _short_path(path: str) -> str:
    cwd = os.getcwd() + os.sep
    path = path[len(cwd):] if path.startswith(cwd) else path
    return path.split("site-packages/", 1)[-1]


def parse_hlo(text: str) -> dict[str, Instruction]:
    """name -> Instruction for every instruction of an HLO module's text."""
    frames = _source_tables(text)
    out, computation = {}, ""
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            computation = m.group(1)
        elif m := _INSTRUCTION.match(line):
            name, rhs = m.groups()
            meta = re.search(r"metadata=\{(.*?)\}(?:,|$)", rhs)
            meta = meta.group(1) if meta else ""
            op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
            source = ""
            if frame := re.search(r"stack_frame_id=(\d+)", meta):
                source = frames.get(int(frame.group(1)), "")
            elif file := re.search(r'source_file="([^"]*)"', meta):   # older XLA
                line_no = re.search(r"source_line=(\d+)", meta)
                source = f"{_short_path(file.group(1))}:{line_no.group(1) if line_no else '?'}"
            calls = re.findall(r"\b(?:body|calls|to_apply)=%?([\w.\-]+)", rhs)
            if branches := re.search(r"branch_computations=\{([^}]*)\}", rhs):
                calls += re.findall(r"%?([\w.\-]+)", branches.group(1))
            opcode, operands = _opcode(rhs)
            op_name = re.sub(r"\\(.)", r"\1", op_name.group(1)) if op_name else ""
            out[name] = Instruction(name, computation, opcode, op_name, source, operands,
                                    tuple(calls))
    _add_hints(out)
    return out


def _add_hints(instructions: dict[str, Instruction]) -> None:
    """XLA's own instructions (layout transposes, copies, a loop body's parameter) carry no
    op_name; name what they act on instead: the operand's op_name (e.g. the parameter
    "state['params']['layers']['w_down']"), or for a loop body's parameter the loop."""
    callers = {}
    for ins in instructions.values():
        for comp in ins.calls:
            callers.setdefault(comp, ins)
    for ins in instructions.values():
        if ins.op_name:
            continue
        if ins.opcode == "parameter" and (caller := callers.get(ins.computation)):
            ins.hint = f"state of {caller.name}: {caller.op_name}"
            ins.source = ins.source or caller.source
        for name in ins.operands:
            if (op := instructions.get(name)) and op.op_name:
                ins.hint = f"of {name}: {op.op_name}"
                ins.source = ins.source or op.source
                break


# ---------------------------------------------------------------------------------------------
# the peak


def _union_bytes(spans: list[tuple[int, int]]) -> int:
    total, reach = 0, -1
    for lo, hi in sorted(spans):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


def _live_bytes(values: list[Value], t: int) -> int:
    """Heap bytes in use at time t: per allocation, the union of live values' byte ranges
    (values that share memory -- in-place updates, loop-carried phis -- count once)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for v in values:
        if v.live[0] <= t <= v.live[1]:
            spans.setdefault(v.allocation, []).append((v.offset, v.offset + v.size))
    return sum(_union_bytes(s) for s in spans.values())


def _peak_time(values: list[Value]) -> tuple[int, int]:
    """(time, bytes) of the peak. One sweep over start/end events counts each distinct
    (allocation, offset, size) slot once, which is exact for values that share a buffer whole
    (the usual aliasing); the few highest times are then measured exactly as byte unions."""
    starts: dict[int, list[Value]] = {}
    stops: dict[int, list[Value]] = {}
    for v in values:
        starts.setdefault(v.live[0], []).append(v)
        stops.setdefault(v.live[1] + 1, []).append(v)     # the end is inclusive
    refs: dict[tuple[int, int, int], int] = {}
    total, candidates = 0, []
    for t in sorted(starts.keys() | stops.keys()):
        for v, step in [(v, -1) for v in stops.get(t, [])] + [(v, 1) for v in starts.get(t, [])]:
            slot = (v.allocation, v.offset, v.size)
            refs[slot] = refs.get(slot, 0) + step
            total += v.size * ((step == 1 and refs[slot] == 1) - (step == -1 and refs[slot] == 0))
        if t in starts:     # the live set only grows when a value starts
            candidates.append((total, t))
    exact = [(_live_bytes(values, t), -t) for _, t in sorted(candidates, reverse=True)[:16]]
    peak, earliest = max(exact, default=(0, 0))     # ties: the earliest time
    return -earliest, peak


def _describe(v: Value, hlo: dict[str, Instruction]) -> dict:
    ins = hlo.get(v.name)
    shape = re.sub(r"\]\{[^{}]*\}", "]", v.shape)     # drop the layout: f32[8,4]{1,0}
    return {"value": v.key + (" (phi)" if v.phi else ""), "shape": shape,
            "opcode": ins.opcode if ins else "", "computation": ins.computation if ins else "",
            "op_name": ins.op_name if ins else "", "source": ins.source if ins else "",
            "hint": ins.hint if ins else "",
            "live": list(v.live) if v.live else None}


def peak_buffers(buffer_assignment: str, live_range: str | None, hlo: str = "", *,
                 top: int = 15) -> dict:
    """The top buffers live at the heap's peak (temporaries and outputs not aliased to a
    parameter), from the three dump texts. One row per occupied byte range of an allocation:
    the values sharing it are listed, the first one defined (phis last) whose instruction
    says where it comes from describes it."""
    allocations = parse_buffer_assignment(buffer_assignment)
    instructions = parse_hlo(hlo) if hlo else {}
    heap = [v for a in allocations if a.kind not in _NOT_HEAP for v in a.values]
    sequence, ranges = parse_live_ranges(live_range) if live_range else ([], {})
    unmatched = 0
    for v in heap:
        v.live = ranges.get(v.key)
        if v.live is None:      # never seen: count it as live throughout, so nothing hides
            unmatched += 1
            v.live = (0, max(len(sequence), 1))
    peak_t, peak = 0, 0
    if ranges:
        peak_t, peak = _peak_time(heap)
        live = [v for v in heap if v.live[0] <= peak_t <= v.live[1]]
    else:
        live = heap     # no live ranges dumped: every heap buffer, an upper bound
        peak = sum(_union_bytes([(v.offset, v.offset + v.size)
                                 for v in heap if v.allocation == a.index])
                   for a in allocations if a.kind not in _NOT_HEAP)
    slots: dict[tuple[int, int], list[Value]] = {}
    for v in live:
        slots.setdefault((v.allocation, v.offset), []).append(v)
    rows = []
    for (alloc, offset), vals in slots.items():
        vals.sort(key=lambda v: (v.phi, v.live[0], -v.size))
        main = next((v for v in vals if v.name in instructions and
                     (instructions[v.name].op_name or instructions[v.name].hint)), vals[0])
        row = {"bytes": max(v.size for v in vals), "allocation": alloc, "offset": offset,
               **_describe(main, instructions),
               "shares_with": [v.key + (" (phi)" if v.phi else "") for v in vals
                               if v is not main][:6]}
        rows.append(row)
    rows.sort(key=lambda r: (-r["bytes"], r["allocation"], r["offset"]))
    kept = rows[:top]
    covered = _union_bytes_by_alloc(kept)
    at = sequence[peak_t] if peak_t < len(sequence) else ""
    at_ins = instructions.get(at)
    return {
        "peak_bytes": peak,
        "heap_allocation_bytes": sum(a.size for a in allocations if a.kind not in _NOT_HEAP),
        "parameter_bytes": sum(a.size for a in allocations if a.kind == "parameter"),
        "peak_at": {"time": peak_t, "instruction": at,
                    "computation": at_ins.computation if at_ins else "",
                    "op_name": at_ins.op_name if at_ins else ""} if ranges else None,
        "live_buffers": len(rows),
        "top": kept,
        "top_bytes": covered,
        "top_fraction": covered / peak if peak else 0.0,
        "unmatched_values": unmatched,
    }


def _union_bytes_by_alloc(rows: list[dict]) -> int:
    spans: dict[int, list[tuple[int, int]]] = {}
    for r in rows:
        spans.setdefault(r["allocation"], []).append((r["offset"], r["offset"] + r["bytes"]))
    return sum(_union_bytes(s) for s in spans.values())


def peak_buffers_from_dump(dump_dir: str | os.PathLike, *, top: int = 15,
                           module: str = "") -> dict:
    """peak_buffers for the optimized module in an XLA dump folder (the one whose name
    contains `module`, else the one with the largest buffer assignment)."""
    found = sorted(pathlib.Path(dump_dir).glob("*after_optimizations-buffer-assignment.txt"),
                   key=lambda p: (module not in p.name, -p.stat().st_size))
    if not found:
        raise FileNotFoundError(f"no *after_optimizations-buffer-assignment.txt in {dump_dir}: "
                                "was the compile run with xla_dump_to?")
    prefix = str(found[0])[:-len("-buffer-assignment.txt")]
    read = lambda p: pathlib.Path(p).read_text() if pathlib.Path(p).exists() else None
    report = peak_buffers(read(found[0]), read(prefix + "-live-range.txt"),
                          read(prefix + ".txt") or "", top=top)
    report["module"] = pathlib.Path(prefix).name
    return report


def compile_with_buffers(lowered, *, top: int = 15, options: dict | None = None):
    """lowered.compile() with XLA dumping into a temporary folder; (compiled, peak_buffers).
    options: further compiler options (xla_flags.compiler_options).
    Dump options do not change the program XLA builds, only what it writes. A dump this
    module cannot read (another XLA's format) gives {'error': ...}, not a failed compile."""
    dump = tempfile.mkdtemp(prefix="titanax-xla-dump-")
    try:
        compiled = lowered.compile(compiler_options={**(options or {}), "xla_dump_to": dump})
        try:
            report = peak_buffers_from_dump(dump, top=top)
        except (OSError, ValueError, KeyError, IndexError) as e:
            report = {"error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    mem = compiled.memory_analysis()
    report["memory_analysis"] = {
        k: int(getattr(mem, k, 0) or 0) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
            "host_alias_size_in_bytes", "host_temp_size_in_bytes")}
    return compiled, report


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_buffers(report: dict) -> list[str]:
    """Lines for the terminal, two per buffer."""
    if "error" in report:
        return [f"  peak buffers: could not read XLA's dump: {report['error']}"]
    at = report.get("peak_at")
    where = (f" at #{at['time']} {at['instruction']} ({at['op_name'] or at['computation']})"
             if at else " (no live ranges dumped: all heap buffers, not only those at the peak)")
    lines = [f"  heap peak {_size(report['peak_bytes'])} (+ {_size(report['parameter_bytes'])} "
             f"parameters){where}; temporaries allocated "
             f"{_size(report['heap_allocation_bytes'])}; {report['live_buffers']} buffers live;"
             f" the top {len(report['top'])} cover {_size(report['top_bytes'])} "
             f"({report['top_fraction']:.0%}):"]
    for i, r in enumerate(report["top"], 1):
        also = f"; shares with {', '.join(r['shares_with'][:3])}" if r["shares_with"] else ""
        live = f" live {r['live'][0]}-{r['live'][1]}" if r.get("live") else ""
        shape = r["shape"] if len(r["shape"]) < 60 else r["shape"][:56] + "...)"   # tuples
        lines.append(f"  {i:3d}. {_size(r['bytes']):>9s}  {shape}  {r['value']} "
                     f"[{r['opcode']}] in {r['computation']}{live}")
        lines.append(f"         {r['op_name'] or '(no op_name) ' + r.get('hint', '')}"
                     + (f"  @ {r['source']}" if r["source"] else "") + also)
    return lines
