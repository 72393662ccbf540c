"""What `python -m launch.bench train` prints and writes: one measurement (optionally beside the
PyTorch peer on the same model), or a scaling sweep with a table and a PNG."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess

import jax

from titanax.config import Config, apply_overrides
from titanax.perf.train_bench import bench_train_step, compile_seconds
from titanax.train.throughput import FLOP_FORMULA, measure_matmul_peak

SWEEPS = {
    # name: (config key varied, values, what is reported against it)
    "layers": ("model.n_layers", [1, 2, 4, 8, 16], "compile_s"),
    "seq": ("train.seq_len", [128, 256, 512, 1024], "step_median_s"),
    "batch": ("train.batch_size", [1, 2, 4, 8, 16], "temp_bytes_per_device"),
    "devices": ("mesh.fsdp", [1, 2, 4, 8], "argument_bytes_per_device"),
}


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def _peer_args(cfg: Config, steps: int, warmup: int, peak_gflops: float, compiled: bool):
    m, t = cfg.model, cfg.train
    args = ["--hidden-size", m.d_model, "--num-hidden-layers", m.n_layers,
            "--num-attention-heads", m.n_heads, "--num-key-value-heads", m.n_kv_heads,
            "--intermediate-size", m.ffn_dim, "--vocab-size", m.vocab_size,
            "--batch", t.batch_size, "--seq", t.seq_len, "--steps", steps,
            "--warmup", warmup + (2 if compiled else 0), "--lr", cfg.optim.lr,
            "--weight-decay", cfg.optim.weight_decay, "--peak-gflops", f"{peak_gflops:.1f}",
            "--threads", os.cpu_count(), "--dtype", "fp32" if cfg.execution.dtype == "float32" else "bf16"]
    return [str(a) for a in args] + (["--compile"] if compiled else [])


def allocator(environ=None) -> str:
    """'tcmalloc' when this process runs with TCMalloc preloaded, else 'glibc malloc'."""
    env = os.environ if environ is None else environ
    return "tcmalloc" if "tcmalloc" in env.get("LD_PRELOAD", "") else "glibc malloc"


def peer_env(environ=None) -> dict:
    """The environment the peer runs in: the user's, without the allocator titanax's launcher
    preloaded for itself (launch/common.py use_tcmalloc), so the peer runs as its users run it.
    A preload the user set (LD_PRELOAD=... python -m launch.bench) applies to both."""
    env = dict(os.environ if environ is None else environ)
    ours = env.pop("TITANAX_PRELOADED", None)
    if ours:
        kept = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != ours]
        if kept:
            env["LD_PRELOAD"] = ":".join(kept)
        else:
            env.pop("LD_PRELOAD", None)
    return env


def run_peer(cfg: Config, peer: str, python: str, *, steps: int, warmup: int,
             peak_gflops: float, compiled: bool) -> dict:
    if not pathlib.Path(python).exists():
        raise FileNotFoundError(f"{python} not found: run `bash scripts/dev.sh setup` to create "
                                "the PyTorch peer environment")
    cmd = [python, peer, *_peer_args(cfg, steps, warmup, peak_gflops, compiled)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=peer_env())
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"peer failed ({' '.join(cmd)}):\n{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def run_single(cfg: Config, *, steps: int, warmup: int, peer: str | None = None,
               peer_python: str = ".venv-torch/bin/python", peer_compile: bool = False) -> dict:
    # One matmul peak for both systems, measured first; the peer runs before titanax allocates
    # anything, since a child process inherits its parent's peak-RSS mark on Linux.
    peak = measure_matmul_peak()
    peers = {}
    if peer:
        for compiled in ([False, True] if peer_compile else [False]):
            peers["peer_compiled" if compiled else "peer"] = run_peer(
                cfg, peer, peer_python, steps=steps, warmup=warmup, peak_gflops=peak / 1e9,
                compiled=compiled)
    res = bench_train_step(cfg, steps=steps, warmup=warmup, peak_flops=peak)
    rows = [{"system": f"titanax (jax {jax.__version__}, {allocator()})",
             "tokens/s": res.tokens_per_s,
             "step_s": res.step_median_s, "p10-p90_s": f"{res.step_p10_s:.3f}-{res.step_p90_s:.3f}",
             "GFLOP/s": res.achieved_flops / 1e9, "MFU": res.mfu,
             "compile_s": res.compile_s, "rss_MiB": res.max_rss_bytes / 2**20}]
    for name, pr in peers.items():
        rows.append({"system": pr["system"] + (" compile" if name == "peer_compiled" else " eager")
                     + f", {allocator(peer_env())}",
                     "tokens/s": pr["tokens_per_s"], "step_s": pr["step_median_s"],
                     "p10-p90_s": f"{pr['step_min_s']:.3f}-{pr['step_max_s']:.3f} (min-max)",
                     "GFLOP/s": pr["achieved_gflops"], "MFU": pr.get("mfu", 0.0),
                     "compile_s": "", "rss_MiB": pr["maxrss_mib"]})
    print(f"{FLOP_FORMULA}; flops/step {res.flops_per_step:.4g}; "
          f"matmul peak (probe) {peak / 1e9:.1f} GFLOP/s")
    print(_table(rows, ["system", "tokens/s", "step_s", "p10-p90_s", "GFLOP/s", "MFU",
                        "compile_s", "rss_MiB"]))
    return {"titanax": dataclasses.asdict(res), "flop_formula": FLOP_FORMULA,
            "peak_gflops": peak / 1e9, **peers}


def run_sweep(cfg: Config, sweep: str, *, steps: int, warmup: int, plot: str | None) -> dict:
    key, values, metric = SWEEPS[sweep]
    rows = []
    for v in values:
        over = {key: v}
        if sweep == "seq":
            over["model.max_seq_len"] = max(cfg.model.max_seq_len, v)
        if sweep == "devices":
            over.update({"mesh.data": jax.device_count() // v})
        c = apply_overrides(cfg, over)
        if sweep == "layers":
            seconds, mem = compile_seconds(c)
            rows.append({key: v, "compile_s": seconds})
        elif sweep == "devices":
            seconds, mem = compile_seconds(c)
            rows.append({key: v, "mesh.data": c.mesh.data,
                         "argument_bytes_per_device": mem.argument_size_in_bytes,
                         "temp_bytes_per_device": mem.temp_size_in_bytes})
        else:
            r = bench_train_step(c, steps=steps, warmup=warmup, devices=jax.devices()[:1])
            rows.append({key: v, "step_median_s": r.step_median_s, "tokens_per_s": r.tokens_per_s,
                         "mfu": r.mfu, "temp_bytes_per_device": r.temp_bytes_per_device,
                         "argument_bytes_per_device": r.argument_bytes_per_device})
        print(_table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
    print(_table(rows, list(rows[0])))
    if plot:
        _plot(rows, key, metric, plot)
        print(f"wrote {plot}")
    return {"sweep": sweep, "key": key, "metric": metric, "rows": rows}


def _plot(rows, key, metric, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r[key] for r in rows], [r[metric] for r in rows], "o-")
    ax.set_xlabel(key)
    ax.set_ylabel(metric)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
