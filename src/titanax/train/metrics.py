"""Throughput accounting and metric writers.

FLOPs per token = 6*N + 12*L*d*S: N the parameters without the input embedding (the output
layer counts), L layers, d model width, S sequence length; the second term is attention's
score and value matmuls (forward + backward, causal mask not discounted), as NVIDIA and MaxText
report MFU. MFU = tokens/s * FLOPs per token / (devices * peak FLOP/s per device).
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from titanax.hardware import lookup_device

# The formula lives with the model specs (models/spec.py); re-exported for the writers here.
from titanax.models.spec import FLOP_FORMULA, flops_per_token  # noqa: E402,F401


def measure_matmul_peak(n: int = 2048, repeats: int = 5, devices=None) -> float:
    """FLOP/s of one large float32 matmul through XLA on one device (the CPU probe): the best of
    a few runs, so the measured peak is what this machine's XLA can do, not a datasheet."""
    device = (devices or jax.devices())[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def peak_flops_per_device(configured: float, compute_dtype: str) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from)."""
    if configured > 0:
        return configured, "train.peak_flops"
    dev = jax.devices()[0]
    hw = lookup_device(getattr(dev, "device_kind", ""))
    if hw is not None:
        return hw.bf16_flops, f"{hw.name} datasheet (dense bf16)"
    if dev.platform == "cpu":
        # All simulated CPU devices share the same cores: the probe measures the whole machine,
        # so each device's share is the probe divided by the device count.
        total = measure_matmul_peak()
        return total / jax.device_count(), f"CPU matmul probe {total / 1e9:.1f} GFLOP/s"
    return 0.0, f"unknown device kind {dev.device_kind!r}: set train.peak_flops"


class MetricsWriter:
    """metrics.jsonl plus TensorBoard events under WORKDIR/tb; writes only on process 0.
    Every row gets `time` (Unix seconds). purge_step: the first step this run writes again
    (a resumed run repeats the steps after its checkpoint); TensorBoard hides the older
    events from there on, as metrics.jsonl drops its rows."""

    def __init__(self, workdir: pathlib.Path, *, enabled: bool = True,
                 purge_step: int | None = None):
        self.enabled = enabled
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tb"), purge_step=purge_step)

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in values.items()},
               "time": round(time.time(), 3)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in row.items():  # TensorBoard stamps its own wall time
            if k not in ("step", "time") and isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def device_memory() -> tuple[int | None, int | None]:
    """(bytes in use, peak bytes in use) on this process's fullest device, where the backend
    keeps allocator statistics (GPUs, TPUs); (None, None) on XLA:CPU. Host-side counters:
    reading them does not wait for the devices."""
    stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
    if not stats:
        return None, None
    return (max(s.get("bytes_in_use", 0) for s in stats),
            max(s.get("peak_bytes_in_use", 0) for s in stats))


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def step_line(step: int, steps: int, row: dict) -> str:
    """One timestamped line per logged step, for logs read without a progress bar (sbatch)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.get("time", time.time())))
    return (f"{stamp} step {step}/{steps} loss {row['loss']:.4f} tok/s "
            f"{row['tokens_per_s']:,.0f} mfu {row['mfu']:.1%} step {row['step_time']:.3f}s "
            f"mem {_gib(row.get('mem_in_use'))}/{_gib(row.get('mem_peak'))} GiB "
            f"skipped {row['skipped_steps']}")


def compiled_memory(compiled) -> dict[str, int]:
    """Bytes per device of a compiled executable (memory_analysis): arguments, outputs,
    aliased outputs (the donated state, which takes no new memory), temporaries, their
    'total' = arguments + outputs - aliased + temporaries, and the same for pinned host
    memory (train.offload_*, remat full_offload: XLA reports it apart). The one reading of
    XLA's numbers: the step log, the memory check and the planner use it."""
    mem = compiled.memory_analysis()
    get = lambda name: int(getattr(mem, name, 0) or 0)  # noqa: E731
    out = {}
    for prefix in ("", "host_"):
        args, outs, alias, temp = (get(f"{prefix}argument_size_in_bytes"),
                                   get(f"{prefix}output_size_in_bytes"),
                                   get(f"{prefix}alias_size_in_bytes"),
                                   get(f"{prefix}temp_size_in_bytes"))
        out.update({f"{prefix}arguments": args, f"{prefix}outputs": outs,
                    f"{prefix}aliased": alias, f"{prefix}temporaries": temp,
                    f"{prefix}total": args + outs - alias + temp})
    return out


def describe_compiled_memory(compiled) -> str:
    """The compiled step's memory per device from XLA's buffer assignment, before it runs."""
    if compiled.memory_analysis() is None:
        return "memory analysis: not reported by this backend"
    m = {k: v / 2**30 for k, v in compiled_memory(compiled).items()}
    text = (f"memory per device: {m['total']:.3f} GiB = arguments {m['arguments']:.3f} + "
            f"outputs {m['outputs']:.3f} - donated {m['aliased']:.3f} + temporaries "
            f"{m['temporaries']:.3f}")
    return text + (f"; pinned host {m['host_total']:.3f} GiB" if m["host_total"] else "")


def _plain(v):
    if isinstance(v, (np.generic, jax.Array)):
        return np.asarray(v).item()
    return v


def read_metrics(workdir) -> list[dict]:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(workdir) -> pathlib.Path | None:
    """WORKDIR/loss.png: training and validation loss against step."""
    rows = read_metrics(workdir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = pathlib.Path(workdir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_runs(runs: dict[str, str | pathlib.Path], out: str | pathlib.Path) -> pathlib.Path:
    """Several runs' curves side by side: training loss (left) and validation loss (right)
    against step, one line per {label: workdir}; for comparisons such as docs/fp8_loss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for label, workdir in runs.items():
        rows = read_metrics(workdir)
        if not rows:
            raise FileNotFoundError(f"{workdir}: no metrics.jsonl rows; is it a run folder?")
        ax_train.plot(*zip(*[(r["step"], r["loss"]) for r in rows if "loss" in r]), label=label)
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if val:
            ax_val.plot(*zip(*val), "o-", label=label)
    for ax, title in ((ax_train, "training loss"), (ax_val, "validation loss")):
        ax.set(title=title, xlabel="step", ylabel="cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    out = pathlib.Path(out)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

