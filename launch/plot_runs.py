"""python -m launch.plot_runs OUT.png LABEL=WORKDIR [LABEL=WORKDIR ...]

Training and validation loss curves of several runs in one picture (e.g. docs/fp8_loss.png)."""

from __future__ import annotations

import argparse

from launch.common import fail


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.plot_runs", description=__doc__)
    p.add_argument("out", help="the PNG to write")
    p.add_argument("runs", nargs="+", metavar="LABEL=WORKDIR")
    args = p.parse_args(argv)
    runs = {}
    for item in args.runs:
        label, sep, workdir = item.partition("=")
        if not sep or not label or not workdir:
            fail(f"{item!r} is not LABEL=WORKDIR (e.g. baseline=runs/tiny)")
        runs[label] = workdir
    from titanax.train.metrics import plot_runs

    try:
        print(plot_runs(runs, args.out))
    except FileNotFoundError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
