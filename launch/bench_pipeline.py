"""python -m launch.bench_pipeline [--stages 4] [--microbatches 8 16] [--virtual-stages 2]

Pipeline bubble: for each schedule (gpipe, circular) and microbatch count, the analytic idle
fraction (PP-1)/(M*V+PP-1) next to the idle fraction the compiled pipeline itself counts (each
stage adds up the ticks it ran a real work item), plus the wall time of one pipelined
forward+backward on simulated CPU devices (the devices share the host's cores, so times say
nothing about overlap; the counted fraction is the measurement)."""

from __future__ import annotations

import argparse
import time

from launch.common import setup_jax


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.bench_pipeline", description=__doc__)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--virtual-stages", type=int, default=2, help="for the circular schedule")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args(argv)
    setup_jax(args.stages)

    import jax
    import jax.numpy as jnp

    from titanax.config import MeshConfig
    from titanax.parallel.mesh import build_mesh, describe_mesh
    from titanax.parallel.pipeline import PipelineSchedule, bubble_fraction, run_pipelined

    mesh = build_mesh(MeshConfig(data=1, pipeline=args.stages))
    print(describe_mesh(mesh))
    w_LDD = jax.random.normal(jax.random.key(0), (args.layers, args.width, args.width)) * 0.05
    print(f"{'schedule':<10} {'PP':>3} {'M':>4} {'V':>3} {'ticks':>6} {'analytic idle':>14} "
          f"{'counted idle':>13} {'fwd+bwd ms':>11}")
    for name, virtual in (("gpipe", 1), ("circular", args.virtual_stages)):
        for micro in args.microbatches:
            sched = PipelineSchedule(micro, virtual)
            x_BD = jax.random.normal(jax.random.key(1), (micro * 4, args.width))

            def loss(w, x):
                out, busy = run_pipelined(lambda h, wl, _: jnp.tanh(h @ wl), w, x, None, sched,
                                          with_busy=True)
                return jnp.mean(out ** 2), busy

            with jax.set_mesh(mesh):
                step = jax.jit(jax.value_and_grad(loss, has_aux=True))
                (_, busy), _ = jax.block_until_ready(step(w_LDD, x_BD))
                t0 = time.perf_counter()
                for _ in range(3):
                    jax.block_until_ready(step(w_LDD, x_BD))
                ms = (time.perf_counter() - t0) / 3 * 1e3
            ticks = micro * virtual + args.stages - 1
            counted = 1 - int(busy.sum()) / (ticks * args.stages)
            print(f"{name:<10} {args.stages:>3} {micro:>4} {virtual:>3} {ticks:>6} "
                  f"{bubble_fraction(args.stages, micro, virtual):>14.4f} {counted:>13.4f} "
                  f"{ms:>11.1f}")


if __name__ == "__main__":
    main()
