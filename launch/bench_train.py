"""python -m launch.bench train [--config FILE] [--set ...] [--steps N] [--warmup N] [--json OUT]
                               [--sweep layers|seq|batch|devices] [--peer PATH] [--host-devices N]

Benchmarks the compiled train step on random tokens (see titanax/perf/train_bench.py for what is
measured and the FLOP formula). --sweep runs one scaling sweep (table, JSON, PNG); --peer runs
the PyTorch peer (shared/bench/hf_torch_train.py) on the same model in the same invocation."""

from __future__ import annotations

import argparse
import json
import pathlib

from launch.common import add_config_flags, add_host_devices_flag, fail, setup_jax

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "peer_cpu.py"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p, default_config=str(DEFAULT_CONFIG))
    add_host_devices_flag(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--sweep", choices=["layers", "seq", "batch", "devices"], default=None)
    p.add_argument("--plot", default=None, help="PNG for --sweep (default: next to --json)")
    p.add_argument("--peer", default=None, help="hf_torch_train.py to run on the same model")
    p.add_argument("--peer-python", default=".venv-torch/bin/python")
    p.add_argument("--peer-compile", action="store_true", help="also run the peer compiled")
    args = p.parse_args(argv)
    if args.steps <= 0 or args.warmup < 0:
        fail("--steps must be > 0 and --warmup >= 0")

    from titanax.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        fail(str(e))
    setup_jax(args.host_devices or (8 if args.sweep == "devices" else 0))

    from titanax.perf import train_sweeps as cli

    try:
        if args.sweep:
            out = cli.run_sweep(cfg, args.sweep, steps=args.steps, warmup=args.warmup,
                                plot=args.plot or (args.json and str(pathlib.Path(args.json)
                                                                     .with_suffix(".png"))))
        else:
            out = cli.run_single(cfg, steps=args.steps, warmup=args.warmup, peer=args.peer,
                                 peer_python=args.peer_python, peer_compile=args.peer_compile)
    except ConfigError as e:
        fail(str(e))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
