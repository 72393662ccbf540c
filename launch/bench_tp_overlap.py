"""python -m launch.bench tp_overlap [--layers N] [--batch B] [--seq S] [--tensor T] [--data D]
[--context C] [--variants ...] [--out FILE]

Is tensor-parallel communication hidden under the GEMMs? Compiles the Llama-3-8B-wide train
step deviceless for H100s (CUDA plugin in .venv/cuda-plugin) with today's GPU flags, with
XLA's windowed-einsum flags, and with our collective matmul, and prints, from the compiled
HLO, the tensor-axis collectives and how many of them run beside a GEMM
(titanax/perf/tp_overlap.py; docs/parallelism.md "Tensor-parallel overlap"). --context 2
--data 1: the same with context parallelism, one tensor ring per context shard.
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> None:
    from titanax.perf import tp_overlap

    p = argparse.ArgumentParser(prog="python -m launch.bench tp_overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = tp_overlap.StepShape()
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--tensor", type=int, default=d.tensor)
    p.add_argument("--data", type=int, default=d.data)
    p.add_argument("--context", type=int, default=d.context,
                   help="context parallelism: the sequence split over this many devices too")
    p.add_argument("--gpu", default=d.gpu)
    p.add_argument("--variants", nargs="+", default=list(tp_overlap.VARIANTS),
                   choices=list(tp_overlap.VARIANTS))
    p.add_argument("--out", default="", help="also write the measurements as JSON here")
    args = p.parse_args(argv)

    from pallas_kernels import aot

    if not aot.plugin_available():
        raise SystemExit("error: the CUDA plugin is not installed in .venv/cuda-plugin "
                         "(bash scripts/dev.sh cuda-plugin installs it); deviceless compiles need it")
    shape = tp_overlap.StepShape(args.layers, args.batch, args.seq, args.tensor, args.data,
                                 args.gpu, args.context)
    result = tp_overlap.measure(shape, args.variants)
    print(tp_overlap.table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
