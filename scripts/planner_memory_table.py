"""Recompiles the rows of docs/planner.md's "Compiled memory against the cost model" table and
prints them as markdown: one deviceless `launch.plan` per row (the GPU XLA flags of real runs,
src/titanax/xla_flags.py), the compiled memory per device against the cost model's.

    .venv/bin/python scripts/planner_memory_table.py [--out runs/planner-table] [--only N ...]

Each row's plan.json stays in OUT/<n>/ and a row already there is not compiled again (delete
the folder to redo it). Needs the CUDA plugin (bash scripts/dev.sh cuda-plugin); about 30
minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
H100x64 = ["--gpu", "h100", "--nodes", "8"]
NEMO = ["--set", "mesh.tensor=4", "--set", "mesh.pipeline=4", "--set", "mesh.data=1",
        "--set", "pipeline.schedule=circular", "--set", "pipeline.virtual_stages=5",
        "--set", "pipeline.microbatches=32", "--set", "execution.attention_impl=auto",
        "--set", "train.batch_size=128"]
LONG = ["--set", "train.seq_len=65536", "--set", "model.max_seq_len=65536",
        "--set", "train.batch_size=32", "--set", "mesh.fsdp=8", "--set", "mesh.context=8",
        "--set", "execution.attention_impl=auto"]
OFFLOAD = ["--set", "train.offload_optimizer=true"]
# The preset ships train.grad_accum=auto; each row is of the count it names (1 unless it sets
# one: a later --set wins), so the rows stay what their labels say.
PIN = ["--set", "train.grad_accum=1"]

ROWS = [
    ("64x H100, FSDP 64, batch 128", H100x64 + ["--set", "train.batch_size=128"]),
    ("64x H100, FSDP 64, batch 256 (`configs/llama3_70b.py` at grad_accum 1; as shipped, `auto` "
     "takes 2: 72.2 GB)", H100x64),
    ("128x H100, FSDP 128, batch 256", ["--gpu", "h100", "--nodes", "16"]),
    ("64x H100, NeMo-like TP4 PP4 FSDP4, circular v5, 32 microbatches, batch 128",
     H100x64 + NEMO + ["--set", "mesh.fsdp=4"]),
    ("the same with `pipeline.schedule=1f1b`",
     H100x64 + NEMO + ["--set", "mesh.fsdp=4", "--set", "pipeline.schedule=1f1b",
                       "--set", "pipeline.virtual_stages=1"]),
    ("64x H100, NeMo's layout with its real CP: TP4 PP4 CP2 (ring) FSDP2, circular v5, "
     "32 microbatches, batch 128",
     H100x64 + NEMO + ["--set", "mesh.fsdp=2", "--set", "mesh.context=2"]),
    ("64x H100, FSDP 16 x CP 4 (ring), remat dots, grad_accum 8, batch 128",
     H100x64 + ["--set", "train.batch_size=128", "--set", "mesh.fsdp=16",
                "--set", "mesh.context=4", "--set", "execution.remat=dots",
                "--set", "train.grad_accum=8", "--set", "execution.attention_impl=auto"]),
    ("64x H100, seq 65,536, batch 32: FSDP 8 x CP 8 (ring), remat full_offload, grad_accum 4",
     H100x64 + LONG + ["--set", "execution.remat=full_offload", "--set", "train.grad_accum=4"]),
    ("the same with remat full", H100x64 + LONG + ["--set", "train.grad_accum=4"]),
    ("the same with remat full, grad_accum 1 (4 rows of 8,192 tokens per GPU)",
     H100x64 + LONG + ["--set", "train.grad_accum=1"]),
    ("8x H100, FSDP 8, batch 8", ["--gpu", "h100", "--nodes", "1", "--set", "train.batch_size=8"]),
    ("8x H100, FSDP 8, batch 8, `train.offload_optimizer` + `execution.remat=full_offload`",
     ["--gpu", "h100", "--nodes", "1", "--set", "train.batch_size=8", *OFFLOAD,
      "--set", "execution.remat=full_offload"]),
    ("8x H100, batch 256, `train.offload_optimizer` + `execution.remat=full_offload`, grad_accum 32",
     ["--gpu", "h100", "--nodes", "1", *OFFLOAD, "--set", "execution.remat=full_offload",
      "--set", "train.grad_accum=32"]),
    ("8x H100, batch 256, `train.offload_optimizer` + `train.offload_params`, grad_accum 16 "
     "(`grad_accum=auto`'s answer)",
     ["--gpu", "h100", "--nodes", "1", *OFFLOAD, "--set", "train.offload_params=true",
      "--set", "train.grad_accum=16"]),
    ("8x B200, FSDP 8, batch 16", ["--gpu", "b200", "--nodes", "1", "--set", "train.batch_size=16"]),
    ("8x B200, FSDP 8, batch 32", ["--gpu", "b200", "--nodes", "1", "--set", "train.batch_size=32"]),
    ("8x B200, FSDP 8, batch 32, `execution.remat=full_offload`",
     ["--gpu", "b200", "--nodes", "1", "--set", "train.batch_size=32",
      "--set", "execution.remat=full_offload"]),
    ("8x B200, batch 256 (as shipped), grad_accum 32 (`grad_accum=auto`'s answer)",
     ["--gpu", "b200", "--nodes", "1", "--set", "train.grad_accum=32"]),
]


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def remodel(flags: list[str]) -> int:
    """The cost model's bytes per device for a row's flags, from this tree's model (the
    compiled figure is the plan.json's): for refitting the model without recompiling."""
    sys.path[:0] = [str(REPO), str(REPO / "src")]
    from titanax.config import load_config
    from titanax.plan import Cluster, make_plan

    gpu, nodes = flags[flags.index("--gpu") + 1], int(flags[flags.index("--nodes") + 1])
    sets = [PIN[1], *(flags[i + 1] for i, f in enumerate(flags) if f == "--set")]
    cfg = load_config(REPO / "configs" / "llama3_70b.py", sets)
    return make_plan(cfg, Cluster(gpu, nodes), compile_step=False)["memory_model_bytes"]["total"]


def row(label: str, plan: dict, model: int | None = None) -> str:
    comp = plan.get("compile") or {}
    model = plan["memory_model_bytes"]["total"] if model is None else model
    host_model = (plan.get("host_memory_model_bytes") or {}).get("total", 0)
    if not comp.get("ok"):
        return f"| {label} | compile failed: {comp.get('error', '')[:80]} | {_gb(model)} | | |"
    mem = comp["memory"]
    total, host = mem["total"], mem.get("host_total", 0)
    usable = plan["usable_memory_bytes"]
    compiled = (f"{_gb(total)} (args {_gb(mem['arguments'])} + temps "
                f"{_gb(mem['temporaries'])})" + (f", host {_gb(host)}" if host else ""))
    modelled = _gb(model) + (f", host {_gb(host_model)}" if host_model else "")
    error = (model - total) / total
    verdict = (f"fits, {_gb(usable - total)} GB spare" if total <= usable else
               f"does not fit by {_gb(total - usable)} GB")
    return f"| {label} | {compiled} | {modelled} | {error:+.0%} | {verdict} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/planner-table")
    ap.add_argument("--only", type=int, nargs="*", help="row numbers (1-based) to run")
    ap.add_argument("--remodel", action="store_true",
                    help="the cost model column from this tree, the compiled one as stored")
    args = ap.parse_args(argv)
    out = REPO / args.out
    lines = ["| plan | compiled (GB per device) | cost model | model error | verdict |",
             "| --- | --- | --- | --- | --- |"]
    for n, (label, flags) in enumerate(ROWS, 1):
        if args.only and n not in args.only:
            continue
        folder = out / str(n)
        if not (folder / "plan.json").exists():
            cmd = [sys.executable, "-m", "launch.plan", "--config", "configs/llama3_70b.py",
                   *PIN, *flags, "--out", str(folder)]
            print(f"[{n}/{len(ROWS)}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, check=False)
        if (folder / "plan.json").exists():
            lines.append(row(label, json.loads((folder / "plan.json").read_text()),
                             remodel(flags) if args.remodel else None))
        else:
            lines.append(f"| {label} | no plan.json (see the command's output) | | | |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
