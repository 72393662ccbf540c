"""python -m launch.bench attention|checkpoint|fp8|train|tp_overlap [...]: each benchmark lives
in its own module (launch/bench_<name>.py) with its own flags; this only dispatches."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "attention": "launch.bench_attention",
    "checkpoint": "launch.bench_checkpoint",
    "fp8": "launch.bench_fp8",
    "train": "launch.bench_train",
    "tp_overlap": "launch.bench_tp_overlap",
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m launch.bench {{{'|'.join(BENCHMARKS)}}} [--help]", file=sys.stderr)
        raise SystemExit(2)
    try:
        module = importlib.import_module(BENCHMARKS[argv[0]])
    except ModuleNotFoundError as e:
        print(f"error: benchmark {argv[0]!r} is not available in this checkout ({e})",
              file=sys.stderr)
        raise SystemExit(2) from None
    module.main(argv[1:])


if __name__ == "__main__":
    from launch.common import use_tcmalloc

    use_tcmalloc()
    main()
