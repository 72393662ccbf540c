"""Every shipped GPU preset, compiled for the GPU without one and audited (plan/audit.py): the
program a GPU would run does only the work it needs, for each matmul recipe, with and without
packed documents.

A cell is (preset, GPU, matmul precision, documents): configs/<preset>.py cut to LAYERS
layers at SEQ_LEN tokens, one sequence per device of one 8-GPU node (FSDP over all eight, as
the presets lay out), compiled with the GPU flags launch.train uses. Documents on: data.source
names a shard folder (which need not exist: the compile reads no data), so the step passes
segment ids to attention; off: the presets' synthetic data, which has none. mxfp8 only on
Blackwell: Hopper has no block-scaled MMA and refuses it.

The cells of one GPU kind compile in one subprocess with the CUDA plugin (import and plugin
start once per kind): `audit_cells(cells)`; `python -m launch.audit_presets` runs the whole matrix and writes
its table into docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

from pallas_kernels import aot
from titanax.config import Config, load_config

PRESETS = ("llama3_8b", "llama3_70b", "llama3_405b")
PRECISIONS = {"h100": ("default", "fp8_tensorwise", "fp8_delayed", "fp8_rowwise"),
              "b200": ("default", "fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "mxfp8")}
LAYERS = 2
# No weight dimension of the presets equals it, fused projections included (6,144 is the 8B's
# [q|k|v] width), so an S x S array is unambiguous; a whole number of every kernel's tiles.
SEQ_LEN = 5120
GPUS = 8
DOC_SOURCE = "preset-audit/documents"  # a shard folder name: segment ids reach attention
_RESULT = "PRESET_AUDIT_RESULT "


# `duplicates` pairs this record with plan/published.py's Published: typed fields alike in
# shape only, different records, no logic to share.
@dataclasses.dataclass(frozen=True)
class Cell:
    preset: str
    gpu: str
    precision: str
    documents: bool

    def label(self) -> str:
        return (f"{self.preset} {self.gpu} {self.precision} "
                f"{'documents' if self.documents else 'no documents'}")


def full_matrix(presets=PRESETS, gpus=tuple(PRECISIONS)) -> list[Cell]:
    return [Cell(p, g, prec, docs) for p in presets for g in gpus for prec in PRECISIONS[g]
            for docs in (False, True)]


def cell_config(cell: Cell) -> Config:
    overrides = [f"model.n_layers={LAYERS}", f"train.seq_len={SEQ_LEN}",
                 f"model.max_seq_len={SEQ_LEN}", f"train.batch_size={GPUS}",
                 "train.grad_accum=1", f"execution.matmul_precision={cell.precision}"]
    if cell.documents:
        overrides.append(f"data.source={DOC_SOURCE}")
    return load_config(aot.REPO / "configs" / f"{cell.preset}.py", overrides)


def audit_cells(cells: list[Cell], timeout_s: float = 3600) -> list[dict]:
    """One row per cell: {'cell', 'ok', 'findings', 'attention', 'gemms', 'ratio',
    'compile_s'} or {'cell', 'ok': False, 'error'}. Needs the CUDA plugin."""
    if not aot.plugin_available():
        raise RuntimeError("the preset audit compiles for GPUs: it needs the CUDA plugin in "
                           ".venv/cuda-plugin (bash scripts/dev.sh cuda-plugin installs it)")
    from titanax.plan.compile import worker_env

    env, target = worker_env(GPUS)
    assert target == "gpu"
    rows = {}
    # One process per GPU kind: Mosaic GPU kernels lowered for one chip in a process do not
    # lower for another in the same process (a B200 kernel after H100 ones: "Pass pipeline
    # failed"), as no real run ever needs.
    for gpu in dict.fromkeys(c.gpu for c in cells):
        mine = [c for c in cells if c.gpu == gpu]
        specs = [{"cell": dataclasses.asdict(c), "config": cell_config(c).to_dict()}
                 for c in mine]
        proc = subprocess.run([sys.executable, "-m", "titanax.plan.preset_audit",
                               json.dumps(specs)], env=env, capture_output=True, text=True,
                              timeout=timeout_s, cwd=aot.REPO)
        got = [json.loads(l[len(_RESULT):]) for l in proc.stdout.splitlines()
               if l.startswith(_RESULT)]
        if len(got) != len(mine):
            raise RuntimeError(f"preset audit worker ({gpu}) exited {proc.returncode} after "
                               f"{len(got)} of {len(mine)} cells:\n{proc.stderr[-3000:]}")
        rows.update((Cell(**r["cell"]), r) for r in got)
    return [rows[c] for c in cells]


def _summary(cell: dict, result: dict) -> dict:
    audit = result["audit"]
    attention = sorted({f"{a['kind']} ({a.get('mask_type') or 'mask'})"
                        for a in audit["attention"]})
    return {"cell": cell, "ok": True, "findings": audit["findings"], "attention": attention,
            "gemms": sorted(audit["gemms_by_kind"]), "ratio": audit["flops"]["ratio"],
            "s_by_s": len(audit["s_by_s"]), "compile_s": result["compile_s"]}


def _worker(specs: list[dict]) -> None:
    """In the subprocess: compile and audit each cell, one result line each as it finishes."""
    from titanax.plan.cluster import Cluster
    from titanax.plan.compile import compile_train_step

    for spec in specs:
        cell = spec["cell"]
        t0 = time.perf_counter()
        try:
            result = compile_train_step(Config.from_dict(spec["config"]),
                                        Cluster(cell["gpu"], 1, GPUS), "gpu", audit=True)
            row = _summary(cell, result)
        except Exception as e:  # noqa: BLE001 - one failing cell is a row, not the end
            row = {"cell": cell, "ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}",
                   "compile_s": time.perf_counter() - t0}
        print(_RESULT + json.dumps(row), flush=True)


def format_table(rows: list[dict]) -> str:
    """A markdown table of the rows (docs/planner.md's)."""
    out = ["| preset | GPU | matmul | documents | attention | GEMMs | compiled / expected "
           "FLOPs | S x S | findings |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r["cell"]
        head = f"| {c['preset']} | {c['gpu']} | {c['precision']} | {'yes' if c['documents'] else 'no'} |"
        if not r["ok"]:
            out.append(f"{head} | | | | | error: {r['error'][:200]} |")
            continue
        out.append(f"{head} {', '.join(r['attention'])} | {', '.join(r['gemms'])} | "
                   f"{r['ratio']:.3f} | {r['s_by_s']} | "
                   f"{'; '.join(r['findings']) or 'none'} |")
    return "\n".join(out)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
