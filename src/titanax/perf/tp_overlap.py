"""Is tensor-parallel communication hidden under the GEMMs? The evidence, from the compiler.

Builds the real train step (train/memory_fit.lower_train_step) of a Llama-3-8B-wide layer stack
(`llama3_gpu_config`: bf16 compute, fp32 master weights, full remat, cuDNN attention) on a
tensor x data (or tensor x context x data: `StepShape.context`) mesh of compile-only H100s and
compiles it deviceless, each variant in its own subprocess (the CUDA plugin,
pallas_kernels.aot; XLA reads its flags once per process): 'xla' (titanax.xla_flags.GPU_FLAGS),
'xla+windowed_einsum' (plus WINDOWED_EINSUM_FLAGS) and 'collective_matmul' (GPU_FLAGS and
execution.tp_overlap=true: the train step traces its model inside parallel.collective_matmul's
use_collective_matmul(), as launch.train does). From each scheduled HLO (perf/hlo_text.py):

- the collectives whose groups span exactly the 'tensor' axis, by kind, with the bytes one
  device sends (ring formulas);
- which of them run beside a GEMM: an async collective with a GEMM scheduled between its
  start and done (or launched on another stream and still running); a sync one is exposed;
- XLA's own collective-matmul loops (`*windowed_dot_general_body*` while loops holding
  tensor-axis collective-permutes and GEMMs), unrolled or not;
- the GEMM count and the compiled memory per device;
- the bytes one device sends in all collectives, on any axes (with context parallelism XLA
  gathers the sequence over context and tensor together, outside the tensor-axis counts).

Counts are static instructions: with the GPU flags XLA's double buffering unrolls a 2-layer
loop, so each per-layer collective appears once per layer and pass (forward, the full remat's
recomputed forward, backward). `python -m launch.bench tp_overlap` prints `table(measure())`;
docs/parallelism.md ("Tensor-parallel overlap") reads it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from titanax import xla_flags
from titanax.perf.hlo_text import (
    COLLECTIVES,
    Instr,
    collective_axes,
    computations,
    reachable,
    wire_bytes,
)

AXIS = "tensor"


# `duplicates` pairs these fields with other frozen dataclasses' (plan/efficiencies.py,
# FlashConfig): a list of named defaults alike in shape only, no logic to share.
@dataclasses.dataclass(frozen=True)
class StepShape:
    """The compiled step: Llama-3-8B widths (d 4096, ffn 14336, 32/8 heads), a short stack."""

    layers: int = 2
    batch: int = 8
    seq: int = 4096
    tensor: int = 4
    data: int = 2
    gpu: str = "h100"
    # Context parallelism (> 1): the sequence split over 'context' too, each context shard
    # running its own tensor rings (parallel/collective_matmul.py); attention 'auto' then
    # (cuDNN's cannot run inside the K/V exchange's shard_map, config/rules.py _check_context).
    context: int = 1

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {"pipeline": 1, "data": self.data, "fsdp": 1, "context": self.context,
                "tensor": self.tensor}

    @property
    def devices(self) -> int:
        return self.data * self.context * self.tensor


# --- reading the compiled step ----------------------------------------------------------------

def _on_axis(ins: Instr, mesh_shape: dict[str, int]) -> bool:
    return ins.collective is not None and collective_axes(ins, mesh_shape) == (AXIS,)


def _flat_body(comps, body: str) -> list[Instr]:
    """A loop body's instructions with those of its conditionals and calls (not of nested
    loops, which are loops of their own)."""
    return [ins for name in reachable(comps, body, into_loops=False) for ins in comps[name]]


def windowed_loops(comps, live: list[str], mesh_shape: dict[str, int]) -> list[dict]:
    """XLA's collective-matmul loops (SPMD 'windowed einsum'): while loops whose body is a
    windowed_dot_general one and holds tensor-axis collective-permutes and GEMMs."""
    loops = []
    for comp in live:
        for ins in comps[comp]:
            body = re.search(r"body=%([\w.\-]+)", ins.rest) if ins.opcode == "while" else None
            if body is None or "windowed_dot_general_body" not in body.group(1):
                continue
            flat = _flat_body(comps, body.group(1))
            permutes = [i for i in flat if i.collective == "collective-permute"
                        and _on_axis(i, mesh_shape)]
            if not permutes or not any(i.is_gemm for i in flat):
                continue
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', ins.rest)
            loops.append({"body": body.group(1), "kind": body.group(1).split("_body_")[1][:2],
                          "unrolled": body.group(1).startswith("unrolled_"),
                          "trips": int(trips.group(1)) if trips else None,
                          "permutes": len(permutes),
                          "async_permutes": sum(i.is_async_start for i in permutes),
                          "gemms": sum(i.is_gemm for i in flat)})
    return loops


def _runs_gemm(ins: Instr, comps) -> bool:
    """A GEMM, or a fusion wrapping one (XLA's dynamic-slice fusion around a cuBLAS call
    that reads a slice of its operand in place)."""
    if ins.is_gemm:
        return True
    body = re.search(r"\bcalls=%([\w.\-]+)", ins.rest) if ins.opcode == "fusion" else None
    return bool(body) and any(i.is_gemm for i in comps.get(body.group(1), ()))


def _gemm_busy(instrs: list[Instr], comps) -> list[tuple[int, int]]:
    """(first, last) schedule positions during which each GEMM runs: one position for a
    GEMM on the main stream, start..done for one launched on another stream."""
    done_at = {op: i for i, ins in enumerate(instrs) if ins.opcode == "fusion-done"
               for op in ins.operands}
    return [(i, done_at.get(ins.name, i)) for i, ins in enumerate(instrs)
            if _runs_gemm(ins, comps)]


def _beside_gemm(instrs: list[Instr], i: int, busy) -> bool:
    """Whether the async collective started at instrs[i] has a GEMM running before its done."""
    if not instrs[i].is_async_start:
        return False  # a sync collective blocks the stream: exposed
    name = instrs[i].name
    done = next((j for j in range(i + 1, len(instrs))
                 if instrs[j].opcode.endswith("-done") and name in instrs[j].operands),
                len(instrs))
    return any(a <= done and b >= i for a, b in busy)


def tensor_collectives(comps, live: list[str], mesh_shape: dict[str, int]) -> dict:
    """{kind: {'count', 'beside_gemm', 'wire_mb', 'wire_mb_beside_gemm'}} for the tensor-axis
    collectives of the program (wire MB: what one device sends, hlo_text.wire_bytes)."""
    out = {op: {"count": 0, "beside_gemm": 0, "wire_mb": 0.0, "wire_mb_beside_gemm": 0.0}
           for op in COLLECTIVES}
    for comp in live:
        instrs = comps[comp]
        busy = _gemm_busy(instrs, comps)
        for i, ins in enumerate(instrs):
            if not _on_axis(ins, mesh_shape):
                continue
            row, mb = out[ins.collective], wire_bytes(ins) / 2**20
            row["count"] += 1
            row["wire_mb"] += mb
            if _beside_gemm(instrs, i, busy):
                row["beside_gemm"] += 1
                row["wire_mb_beside_gemm"] += mb
    return out


def analyze(hlo_text: str, mesh_shape: dict[str, int]) -> dict:
    """Tensor-axis collectives, XLA windowed loops and GEMM count of one compiled program."""
    comps = computations(hlo_text)
    entry = re.search(r"^ENTRY %([\w.\-]+)", hlo_text, re.M).group(1)
    live = reachable(comps, entry)  # executed computations: not fusion bodies or reducers
    collectives = tensor_collectives(comps, live, mesh_shape)
    wire = sum(r["wire_mb"] for r in collectives.values())
    hidden = sum(r["wire_mb_beside_gemm"] for r in collectives.values())
    return {"collectives": collectives, "windowed_loops": windowed_loops(comps, live, mesh_shape),
            "gemms": sum(_runs_gemm(ins, comps) for comp in live for ins in comps[comp]),
            "wire_mb": wire, "wire_fraction_beside_gemm": hidden / wire if wire else 0.0,
            "wire_mb_all_axes": all_axes_wire_mb(comps, live)}


def all_axes_wire_mb(comps, live: list[str]) -> float:
    """MiB one device sends in every collective, on any mesh axes: with context parallelism
    XLA gathers the layers' sequence over ('context', 'tensor') together, which the
    tensor-axis columns do not count."""
    return sum(wire_bytes(ins) for comp in live for ins in comps[comp]
               if ins.collective is not None) / 2**20


# --- compiling it -----------------------------------------------------------------------------

# What is compared: today's GPU flags; those plus XLA's windowed einsum; our collective matmul.
VARIANTS = {
    "xla": {"flags": xla_flags.GPU_FLAGS, "collective_matmul": False},
    "xla+windowed_einsum": {"flags": xla_flags.GPU_FLAGS + xla_flags.WINDOWED_EINSUM_FLAGS,
                            "collective_matmul": False},
    "collective_matmul": {"flags": xla_flags.GPU_FLAGS, "collective_matmul": True},
}


def step_config(shape: StepShape, collective_matmul: bool = False):
    """The GPU recipe's Llama-3-8B config cut to `shape` (layers, batch, sequence, mesh), with
    execution.tp_overlap=collective_matmul."""
    from titanax.config import MeshConfig
    from titanax.recipes import llama3_gpu_config

    cfg = llama3_gpu_config("llama3_8b", batch_size=shape.batch, lr=3e-4)
    attention = cfg.execution.attention_impl if shape.context == 1 else "auto"
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, n_layers=shape.layers),
        execution=dataclasses.replace(cfg.execution, attention_impl=attention,
                                      tp_overlap=collective_matmul),
        mesh=MeshConfig(data=shape.data, fsdp=1, tensor=shape.tensor, pipeline=1,
                        context=shape.context),
        train=dataclasses.replace(cfg.train, seq_len=shape.seq))


def compile_step(shape: StepShape, collective_matmul: bool) -> tuple[str, dict]:
    """In this process (CPU runtime, CUDA plugin importable, XLA_FLAGS set): the train step
    compiled for `shape` on compile-only GPUs; its scheduled HLO text and memory per device."""
    from pallas_kernels import aot
    from titanax.parallel.mesh import build_mesh
    from titanax.parallel.rules import model_context
    from titanax.train.memory_fit import compiled_memory, lower_train_step

    devices = aot.gpu_topology(shape.gpu, f"1x1x{shape.devices}").devices
    cfg = step_config(shape, collective_matmul)
    mesh = build_mesh(cfg.mesh, devices)
    lowered = lower_train_step(cfg, mesh)  # execution.tp_overlap: traced with the rings
    with model_context(mesh):
        compiled = lowered.compile()
    return compiled.as_text(), compiled_memory(compiled)


def compile_in_subprocess(shape: StepShape, variant: str, timeout_s: float = 600) -> dict:
    """compile_step in a fresh process with the variant's XLA flags: {'hlo', 'memory',
    'compile_s'}, or {'error'}."""
    from pallas_kernels import aot

    env = aot.cuda_plugin_env()
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(aot.REPO), str(aot.REPO / "src")))
    env["XLA_FLAGS"] = " ".join(VARIANTS[variant]["flags"])
    spec = {"shape": dataclasses.asdict(shape),
            "collective_matmul": VARIANTS[variant]["collective_matmul"]}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "step.hlo")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "titanax.perf.tp_overlap",
                                   json.dumps(spec), out], env=env, cwd=aot.REPO,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"compile did not finish within {timeout_s:.0f} s"}
        if proc.returncode or not os.path.exists(out):
            return {"error": proc.stderr[-3000:] or f"exit {proc.returncode}"}
        with open(out) as f, open(out + ".json") as m:
            return {"hlo": f.read(), "memory": json.load(m),
                    "compile_s": time.perf_counter() - t0}


def measure(shape: StepShape = StepShape(), variants=tuple(VARIANTS),
            timeout_s: float = 600) -> dict:
    """{'shape', variant: analyze(...) + 'compile_s' (or {'error'})} for each variant."""
    result = {"shape": dataclasses.asdict(shape)}
    for name in variants:
        compiled = compile_in_subprocess(shape, name, timeout_s)
        result[name] = ({"error": compiled["error"]} if "error" in compiled else
                        {**analyze(compiled["hlo"], shape.mesh_shape),
                         "memory": compiled["memory"], "compile_s": compiled["compile_s"]})
    return result


def table(result: dict) -> str:
    """The comparison as text: per variant, tensor-axis collectives by kind (how many beside
    a GEMM), the bytes one device sends over 'tensor', the share sent beside GEMMs."""
    sh = result["shape"]
    lines = [f"tensor-axis collectives of one train step: Llama-3-8B widths, {sh['layers']} "
             f"layers, batch {sh['batch']} x seq {sh['seq']}, tensor {sh['tensor']} x "
             f"{_other_axes(sh)}, {sh['gpu'].upper()} (deviceless compile; static HLO counts, "
             "beside GEMM / total)",
             f"{'variant':<22}{'compile':>8}{'all-gather':>12}{'red-scatter':>12}"
             f"{'all-reduce':>12}{'all-to-all':>12}{'permute':>10}{'MiB/dev':>11}"
             f"{'beside GEMM':>12}{'XLA loops':>11}{'temp GB':>9}{'all-axes MiB':>13}"]
    for name in VARIANTS:
        r = result.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"{name:<22} failed: {r['error'].splitlines()[-1][:100]}")
            continue
        cells = [f"{c['beside_gemm']}/{c['count']}" for c in r["collectives"].values()]
        loops = r["windowed_loops"]
        lines.append(f"{name:<22}{r['compile_s']:>7.0f}s{cells[0]:>12}{cells[1]:>12}"
                     f"{cells[2]:>12}{cells[3]:>12}{cells[4]:>10}{r['wire_mb']:>11.0f}"
                     f"{r['wire_fraction_beside_gemm']:>11.0%}"
                     f"{sum(l['unrolled'] for l in loops):>5}u/{len(loops):<5}"
                     f"{r['memory']['temporaries'] / 1e9:>9.1f}"
                     f"{r.get('wire_mb_all_axes', float('nan')):>13.0f}")
    return "\n".join(lines)


def _other_axes(sh: dict) -> str:
    """'data 2' or 'context 2 x data 1': the mesh beside 'tensor' (older results: no context)."""
    context = sh.get("context", 1)
    return f"data {sh['data']}" if context == 1 else f"context {context} x data {sh['data']}"


def main(argv: list[str]) -> None:
    """Worker: `python -m titanax.perf.tp_overlap SPEC_JSON OUT_FILE` writes the HLO to
    OUT_FILE and the memory per device to OUT_FILE.json."""
    spec = json.loads(argv[0])
    text, memory = compile_step(StepShape(**spec["shape"]), spec["collective_matmul"])
    with open(argv[1], "w") as f, open(argv[1] + ".json", "w") as m:
        f.write(text)
        json.dump(memory, m)


if __name__ == "__main__":
    main(sys.argv[1:])
