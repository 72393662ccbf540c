"""An audit of the compiled train step: does the program the GPU will run do only the work it
needs? Read from the optimized HLO text of the deviceless compile (`launch.plan --audit`, the
"audit" key of plan.json), per device:

- attention calls: what runs them (cuDNN's fused attention, our Mosaic GPU / Pallas Triton
  kernels, XLA's own dots), mask type, causal or not, FLOPs;
- GEMMs by kind (cuBLAS, cuBLASLt, Triton, cuDNN, our kernels, loop fusions) with their FLOPs;
- the compiled matmul FLOPs (GEMMs + attention, counted from shapes and loop trip counts by
  perf/hlo_flops.py, since cost_analysis() is None without a GPU) against the expected;
- S x S arrays, the largest buffers, collectives by dtype.

Findings (one line each; `launch.plan --audit` exits non-zero on any): an S x S array; a cuDNN
attention call with a dense mask (a bias / mask operand, or for causal self-attention a mask
type other than CAUSAL / PADDING_CAUSAL); a dot of >= 1 GFLOP outside a library, Triton or kernel
call; compiled matmul FLOPs more than 10% above the expected.

Expected executed FLOPs per token (`expected_flops`). The model formula (models/spec.py,
FLOP_FORMULA) is 6*N + 12*L*d*S: N the parameters without the input embedding, L layers,
d = n_heads * head_dim, S the sequence length, attention counted in full (forward 4*L*d*S,
backward twice that). What the step must execute differs from it in three ways:

    A = 2*L*d*S                      attention forward at its causal half (4*L*d*S / 2)
    executed = 6*N + A + 2.5*A       forward + FlashAttention-2 backward (recomputes S = Q K^T:
                                     5 matmuls against the forward's 2)
             + R                     the forward the remat policy recomputes in the backward:
        R = 2*N_layers + A           remat full / full_offload (N_layers = N - vocab*d_model: the
                                     output layer is outside the remat)
        R = A                        remat dots / dots_no_batch (GEMM outputs are saved; the
                                     attention call is not a dot, so its forward runs again)
        R = 0                        remat none

LoRA (lora.rank > 0) computes no base weight gradient: 6*N becomes 4*N + 6*N_a (N_a the
adapters' parameters, plan/lora.py) and full remat recomputes 2*N_a more, so an audit of a LoRA
step finds base weight gradients the step should not compute.

Pipeline layouts multiply the layers' share by ticks / busy ticks (idle ticks compute masked
work: (M*V + P - 1) / (M*V) for gpipe and circular; 1f1b's idle slots are conds, which the
count takes at their largest branch: (M + 2(P - 1)) / M, with its full recompute). Per device:
x tokens per step / devices. Our split dq / dkv backward kernels execute 7 units, not 5 (their
FLOPs are counted as executed), and segment-aware kernels skip tiles the count includes: both
stay well inside the 10% at the shipped sequence lengths.

The S x S test: an array with two dims equal to train.seq_len. When seq_len equals a weight
dimension (d_model, the attention widths, ffn_dim, vocab; Llama-3-70B at 8192), weights and
[.., S, d] activations have that shape too: then only arrays whose source line is attention
code count, the others are reported as ambiguous. Audit at another seq_len (the issue's 6144)
to see every S x S array.
"""

from __future__ import annotations

import math
import re
import time

from titanax.perf import hlo_flops, hlo_text
from titanax.perf.hlo_flops import CAUSAL_MASKS, Matmul

LOOP_DOT_LIMIT = 1e9    # a dot this large outside a library / Triton / kernel call is a finding
FLOPS_OVER = 0.10       # compiled matmul FLOPs this far above the expected is a finding
_ALIASES = ("get-tuple-element", "bitcast", "tuple", "while", "conditional", "call",
            "opt-barrier")


def expected_flops(cfg, n_devices: int) -> dict:
    """The matmul FLOPs one device must execute per step (the module docstring's formula)."""
    from titanax.plan.state_shape import plan_state

    m, s = cfg.model, cfg.train.seq_len
    state = plan_state(cfg)
    width = m.n_heads * m.resolved_head_dim
    n = state.n_no_embed
    n_layers = n - m.vocab_size * m.d_model     # all but the output layer (and the embedding)
    a = 2.0 * m.n_layers * width * s            # attention forward at its causal half
    n_a = state.training.adapter_params         # 0 without LoRA
    # the base's backward: dx, and dW for the share of its weight gradients computed (LoRA: 0)
    grads = 2.0 + 2.0 * state.training.weight_gradients
    recompute = {"full": 2.0 * (n_layers + n_a) + a, "full_offload": 2.0 * (n_layers + n_a) + a,
                 "dots": a, "dots_no_batch": a}.get(cfg.execution.remat, 0.0)
    p, mb = cfg.mesh.pipeline, cfg.pipeline.microbatches
    idle = 1.0
    if p > 1 and cfg.pipeline.schedule == "1f1b":
        idle, recompute = (mb + 2 * (p - 1)) / mb, 2.0 * (n_layers + n_a) + a
    elif p > 1:
        v = cfg.pipeline.resolved_virtual_stages
        idle = (mb * v + p - 1) / (mb * v)
    layers = ((2.0 + grads) * n_layers + 6.0 * n_a + 3.5 * a + recompute) * idle
    per_token = (2.0 + grads) * (n - n_layers) + layers
    tokens = cfg.train.batch_size * s
    return {"per_device": per_token * tokens / n_devices, "per_token": per_token,
            "formula_per_token": 6.0 * n + 12.0 * m.n_layers * width * s,
            "terms_per_token": {f"{2 + grads:g}N": (2.0 + grads) * n, "6N_adapters": 6.0 * n_a,
                                "attention (causal, FA-2 backward)": 3.5 * a,
                                f"remat {cfg.execution.remat} recompute": recompute,
                                "pipeline idle ticks": (idle - 1) * layers / idle},
            "tokens_per_step": tokens, "devices": n_devices}


def audit_step(cfg, hlo: str, n_devices: int) -> dict:
    """audit_hlo for cfg's train step compiled on n_devices (what plan/compile.py runs)."""
    m = cfg.model
    q, kv = m.n_heads * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim
    # The fused projections' widths too: [q|k|v] (ops/linear.py's one GEMM) and [gate|up].
    widths = {m.d_model, q, kv, q + 2 * kv, m.ffn_dim, 2 * m.ffn_dim, m.vocab_size}
    return audit_hlo(hlo, seq_len=cfg.train.seq_len, causal=True,
                     expected=expected_flops(cfg, n_devices), weight_dims=widths)


class SquareTest:
    """Which arrays are S x S: two dims equal to seq_len. When seq_len is also a weight
    dimension, weights ([d, d], [layers, d, d]) and activations ([B, S, d], [layers, B, S, d])
    have that shape too: then only arrays made by attention code (its source line) count, the
    rest are `ambiguous`."""

    ATTENTION_SOURCE = re.compile(r"attention|flash|context\.py|mask")

    def __init__(self, seq_len: int, weight_dims=()):
        self.seq_len, self.collides = seq_len, seq_len in set(weight_dims)

    def _two(self, dims) -> bool:
        return sum(d == self.seq_len for d in dims) >= 2

    def ambiguous(self, dims, where: str = "") -> bool:
        return self.collides and self._two(dims) and not self.ATTENTION_SOURCE.search(where)

    def __call__(self, dims, where: str = "") -> bool:
        return self._two(dims) and not self.ambiguous(dims, where)


def _bytes(dtype: str, dims) -> int:
    """Bytes of an array: the element width is the number in its type (bf16, f8e4m3fn, s32)."""
    bits = re.search(r"\d+", dtype)
    return math.prod(dims) * (8 if dtype == "pred" else int(bits[0]) if bits else 0) // 8


def _executed(comps, entry: str) -> tuple[list[str], dict[str, str]]:
    """(the computations control flow runs, {fusion body: the top-level fusion running it})."""
    seen, todo, bodies = {}, [entry], {}
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen[name] = True
        for ins in comps[name]:
            todo += ins.called()
            if ins.opcode in ("async-start", "call"):
                todo += [c for c in [ins.attr(r"\b(?:calls|to_apply)=%([\w.\-]+)")] if c]
            elif ins.opcode in ("fusion", "fusion-start"):
                stack = [ins.fusion_body]
                while stack:
                    body = stack.pop()
                    if body and body not in bodies:
                        bodies[body] = ins.name
                        stack += [i.fusion_body for i in comps.get(body, ())
                                  if i.opcode == "fusion"]
    return list(seen), bodies


def _arrays(comps, entry: str, frames: dict, square: SquareTest, top: int) -> dict:
    """S x S arrays (materialised or inside a fusion) and the largest buffers."""
    executed, bodies = _executed(comps, entry)
    found, ambiguous, sizes = {}, 0, {}
    for comp in executed + list(bodies):
        fused = comp in bodies
        for ins in comps[comp]:
            if ins.opcode in _ALIASES or ins.opcode.endswith("-start") or (
                    ins.opcode == "parameter" and (fused or comp != entry)):
                continue
            dims_list = [d for _, d in ins.arrays]
            owner = bodies[comp] if fused else ins.name
            where = frames.get(ins.stack_frame, "")
            if any(square(d, where) for d in dims_list) and owner not in found:
                found[owner] = {"name": owner, "shape": hlo_flops.shape_text(ins.shape),
                                "opcode": ins.opcode, "fused": fused,
                                "inner": ins.name if fused else "",
                                "where": where}
            ambiguous += any(square.ambiguous(d, where) for d in dims_list)
            if not fused and ins.arrays:
                dt, dims = max(ins.arrays, key=lambda a: _bytes(*a))
                key = (f"{dt}[{','.join(map(str, dims))}]", ins.op_name or where or ins.opcode)
                row = sizes.setdefault(key, {"shape": key[0], "op_name": key[1],
                                             "bytes": _bytes(dt, dims), "count": 0,
                                             "example": ins.name})
                row["count"] += 1
    largest = sorted(sizes.values(), key=lambda e: -e["bytes"])[:top]
    return {"s_by_s": list(found.values()), "ambiguous_s_by_s": ambiguous,
            "largest_buffers": largest}


def audit_hlo(hlo: str, *, seq_len: int, expected: dict | float | None = None,
              causal: bool = True, weight_dims=(), top: int = 8) -> dict:
    """The audit of one compiled program (optimized HLO text, per device) as a JSON-able dict
    with its "findings" (one line each; none: the step does only the work it needs).
    expected: expected_flops()'s dict, or the expected matmul FLOPs per device; causal: the
    model's attention is causal self-attention (kernel calls are counted causal);
    weight_dims: the model's weight dimensions (SquareTest)."""
    t0 = time.perf_counter()
    comps = hlo_text.computations(hlo)
    entry, frames = hlo_text.entry_name(hlo), hlo_text.stack_frames(hlo)
    square = SquareTest(seq_len, weight_dims)
    counter = hlo_flops.Counter(comps, frames, causal=causal, square=square)
    matmuls = counter.walk(entry)
    if isinstance(expected, (int, float)):
        expected = {"per_device": float(expected)}
    out = {"seq_len": seq_len, "causal": causal,
           "attention": _attention_rows(m for m in matmuls if m.category == "attention"),
           "gemms_by_kind": _by_kind(m for m in matmuls if m.category == "gemm"),
           "largest_gemms": [_row(m) for m in sorted(
               (m for m in matmuls if m.category == "gemm"), key=lambda m: -m.total)[:top]],
           "outside_library": [_row(m) for m in matmuls if not m.library],
           "flops": _flops(matmuls, expected),
           **_arrays(comps, entry, frames, square, top),
           "collectives": hlo_text.collective_dtypes(hlo),
           "loops": counter.loops}
    out["findings"] = findings(out, matmuls)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _row(m: Matmul) -> dict:
    return {"name": m.name, "kind": m.kind, "shape": m.shape, "flops": m.flops,
            "count": m.count, "total_flops": m.total, "where": m.where, **m.detail}


def _attention_rows(matmuls) -> list[dict]:
    """One row per distinct call (implementation, direction, mask, FLOPs, source): count sums
    the executions, instructions the HLO instructions."""
    rows: dict[tuple, dict] = {}
    for m in matmuls:
        key = (m.kind, m.detail.get("direction"), m.detail.get("mask_type"), m.flops, m.where)
        row = rows.setdefault(key, {**_row(m), "count": 0, "total_flops": 0.0,
                                    "instructions": []})
        row["count"] += m.count
        row["total_flops"] += m.total
        row["instructions"].append(m.name)
    return list(rows.values())


def _by_kind(matmuls) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for m in matmuls:
        k = out.setdefault(m.kind, {"instructions": 0, "executions": 0, "flops": 0.0,
                                    "largest_flops": 0.0, "library": m.library})
        k["instructions"] += 1
        k["executions"] += m.count
        k["flops"] += m.total
        k["largest_flops"] = max(k["largest_flops"], m.flops)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["flops"]))


def _flops(matmuls: list[Matmul], expected: dict | None) -> dict:
    compiled = sum(m.total for m in matmuls)
    out = {"compiled": compiled,
           "attention": sum(m.total for m in matmuls if m.category == "attention"),
           "gemm": sum(m.total for m in matmuls if m.category == "gemm")}
    if expected:
        out.update(expected=expected["per_device"], expected_detail=expected,
                   ratio=compiled / expected["per_device"] if expected["per_device"] else None)
    return out


_MAX_LINES = 20  # findings of one kind listed one by one; the rest summed up in one line


def _capped(lines: list[str], what: str) -> list[str]:
    more = len(lines) - _MAX_LINES
    return lines[:_MAX_LINES] + ([f"... and {more} more {what}"] if more > 0 else [])


def _at(where: str) -> str:
    return f" at {where}" if where else ""


def findings(audit: dict, matmuls: list[Matmul]) -> list[str]:
    """One line per finding, naming the instruction, where it comes from and the fix."""
    s, at = audit["seq_len"], _at
    square = [f"S x S array (S={s}): %{a['name']} {a['shape']}"
              + (f" (inside the fusion: %{a['inner']})" if a["fused"] else "")
              + f"{at(a['where'])}: attention scores or mask in full; use causal attention "
              "without a dense mask (cuDNN is_causal, our kernels)" for a in audit["s_by_s"]]
    masks = []
    for m in matmuls:
        if m.kind != "cuDNN fMHA":
            continue
        b, h, q_len, kv_len, d = m.detail["B_H_S_T_D"]
        self_causal = audit["causal"] and q_len == kv_len
        if m.detail["dense_mask"] or (self_causal and m.detail["mask_type"] not in CAUSAL_MASKS):
            masks.append(f"cuDNN attention with a dense mask: %{m.name} ({m.detail['target']}, "
                         f"mask_type {m.detail['mask_type']}, {m.detail['direction']})"
                         f"{at(m.where)}: call jax.nn.dot_product_attention with is_causal=True "
                         "and no mask= / bias= (mask type CAUSAL); packed documents: cuDNN's "
                         "segment support or our kernels")
    loops = [f"dot outside a library, Triton or kernel call: %{m.name} ({m.kind}, {m.shape}, "
             f"{m.flops / 1e9:.1f} GFLOP x {m.count}){at(m.where)}: XLA emits it as a loop on "
             "CUDA cores; give it a GEMM (cuBLAS/cuBLASLt/cuDNN, a Triton GEMM or our kernel)"
             for m in matmuls if not m.library and m.flops >= LOOP_DOT_LIMIT]
    out = (_capped(square, "S x S arrays") + _capped(masks, "dense-mask attention calls")
           + _capped(loops, "loop-emitted dots"))
    f = audit["flops"]
    if f.get("ratio") and f["ratio"] > 1 + FLOPS_OVER:
        out.append(f"compiled matmul FLOPs {f['compiled']:.3e} per device and step are "
                   f"{f['ratio'] - 1:.0%} above the expected {f['expected']:.3e} (limit "
                   f"{FLOPS_OVER:.0%}): see the attention and GEMM tables for full (non-causal) "
                   "attention, recomputation beyond the remat policy, or repeated GEMMs")
    return out


def _g(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def _attention_lines(audit: dict) -> list[str]:
    rows = audit["attention"]
    if not rows:
        return ["  attention calls: none found"]
    out = ["  attention calls (GFLOP per call / per step):",
           f"    {'implementation':22s} {'direction':9s} {'mask':12s} {'causal':6s} {'calls':>5s}"
           f" {'/call':>9s} {'/step':>10s}  instruction, source"]
    for r in rows:
        causal = ("yes*" if r.get("causal_assumed") else "yes") if r.get("causal") else "no"
        name = r["instructions"][0] + (f" (+{len(r['instructions']) - 1})"
                                       if len(r["instructions"]) > 1 else "")
        out.append(f"    {r['kind']:22s} {r.get('direction', '?'):9s} "
                   f"{str(r.get('mask_type', '?')):12s} {causal:6s} {r['count']:5d} "
                   f"{_g(r['flops']):>9s} {_g(r['total_flops']):>10s}  {name}, {r['where']}")
    if any(r.get("causal_assumed") for r in rows):
        out.append("    (* a kernel's mask is not in the HLO: counted causal, as the model is)")
    return out


def _gemm_lines(audit: dict) -> list[str]:
    out = ["  GEMMs by kind:",
           f"    {'kind':28s} {'instructions':>12s} {'executions':>10s} {'GFLOP/step':>12s} "
           f"{'largest GFLOP':>13s}"]
    for kind, k in audit["gemms_by_kind"].items():
        flag = "" if k["library"] else "  <- XLA loop emitter"
        out.append(f"    {kind:28s} {k['instructions']:12d} {k['executions']:10d} "
                   f"{_g(k['flops']):>12s} {_g(k['largest_flops']):>13s}{flag}")
    return out if audit["gemms_by_kind"] else ["  GEMMs: none found"]


def _flops_lines(audit: dict) -> list[str]:
    f = audit["flops"]
    line = (f"  matmul FLOPs per device and step: compiled {f['compiled']:.3e} (attention "
            f"{f['attention']:.3e}, GEMMs {f['gemm']:.3e})")
    if "expected" not in f:
        return [line]
    e = f["expected_detail"]
    out = [line + f"; expected {f['expected']:.3e}: ratio {f['ratio']:.3f} (limit "
           f"{1 + FLOPS_OVER:.2f})"]
    if "terms_per_token" in e:
        terms = ", ".join(f"{k} {v:.3e}" for k, v in e["terms_per_token"].items() if v)
        out.append(f"    expected per token: {terms} = {e['per_token']:.3e} (model formula "
                   f"{e['formula_per_token']:.3e}) x {e['tokens_per_step']:,} tokens / "
                   f"{e['devices']} devices")
    return out


def _array_lines(audit: dict) -> list[str]:
    sq = audit["s_by_s"]
    out = [f"  S x S arrays (S={audit['seq_len']}): "
           + (f"{len(sq)}: " + ", ".join(f"{a['name']} {a['shape']}" for a in sq[:4])
              + (" ..." if len(sq) > 4 else "") if sq else "none")]
    if audit["ambiguous_s_by_s"]:
        out.append(f"    ({audit['ambiguous_s_by_s']} more of that shape outside attention code "
                   "not counted: seq_len equals a weight dimension, so they may be weights or "
                   "activations; audit at another seq_len to see them)")
    out.append("  largest buffers:")
    for b in audit["largest_buffers"]:
        out.append(f"    {b['bytes'] / 1e9:8.2f} GB  {b['shape']:28s} x{b['count']:<3d} "
                   f"{'/'.join(b['op_name'].split('/')[-2:])}")
    coll = "; ".join(f"{op} " + ", ".join(f"{dt} x{n}" for dt, n in types.items())
                     for op, types in audit["collectives"].items())
    out.append(f"  collectives by dtype: {coll or 'none'}")
    unknown = [lp["name"] for lp in audit["loops"] if lp["from"] == "unknown"]
    if unknown:
        out.append(f"  loops of unknown trip count (counted once): {', '.join(unknown)}")
    return out


def format_audit(audit: dict) -> str:
    """The audit as a table for the terminal and the docs."""
    if "skipped" in audit:
        return f"audit: not done: {audit['skipped']}"
    lines = [f"audit of the compiled step (per device; read in {audit['seconds']:.1f} s):",
             *_attention_lines(audit), *_gemm_lines(audit), *_flops_lines(audit),
             *_array_lines(audit)]
    found = audit["findings"]
    lines.append(f"  findings: {len(found) or 'none'}")
    lines += [f"    - {f}" for f in found]
    return "\n".join(lines)
