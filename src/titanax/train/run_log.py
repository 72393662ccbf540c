"""What the run's log and terminal show: the opening lines (processes, accumulation, the
compiled step's memory), a line or a progress bar per logged step, and the allocator's
memory figures that line carries."""

from __future__ import annotations

import sys
import time

import jax

from titanax.config import Config, grad_accum_in_place_unsupported
from titanax.train.memory_fit import describe_compiled_memory


def describe_processes() -> str:
    n = jax.process_count()
    if n == 1:
        return "1 process"
    return (f"{n} processes (jax.distributed), {jax.local_device_count()} local device(s) "
            "each; this log is process 0's")


def describe_accumulation(cfg, pipeline_stages: int = 1) -> str | None:
    """How train.grad_accum sums the microbatches' gradients (None without accumulation);
    pipeline_stages: the mesh's, which mesh.pipeline=-1 leaves to the mesh (train/step.py)."""
    if cfg.train.grad_accum == 1:
        return None
    why = grad_accum_in_place_unsupported(cfg)
    if why is None and pipeline_stages > 1:
        why = "pipeline parallelism: the stages run their own backward schedule"
    if why is None:
        return (f"grad_accum {cfg.train.grad_accum}: gradients summed in place (one float32 "
                "buffer, models/accumulate.py)")
    return (f"grad_accum {cfg.train.grad_accum}: gradients summed the plain way (a fresh "
            f"gradient buffer per microbatch beside the sum): {why}")


def describe_memory(compiled) -> str:
    try:
        return describe_compiled_memory(compiled)
    except Exception as e:  # noqa: BLE001 - a backend without the analysis still trains
        return f"memory analysis unavailable ({type(e).__name__})"


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
            f"skipped {row['skipped_steps']}{_moe_part(row)}")


def _moe_part(row: dict) -> str:
    """An MoE run's routing balance (the aux/ rows, models/common/moe_hooks.py): the
    load-balancing loss (experts_per_token when balanced) and the busiest expert's load over
    the mean (1.0: balanced)."""
    if "aux/max_over_mean_load" not in row:
        return ""
    return (f" balance loss {row.get('aux/load_balance_loss', float('nan')):.3f} "
            f"max/mean load {row['aux/max_over_mean_load']:.2f}")


class Progress:
    def __init__(self, cfg: Config, is_main: bool, start_step: int, log):
        self.log, self.steps, self.bar = log, cfg.train.steps, None
        if (is_main and cfg.train.progress_bar and sys.stdout.isatty()
                and sys.stderr.isatty()):
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train",
                            unit="step", dynamic_ncols=True)

    def say(self, text: str) -> None:
        """A line of text; above the bar, which stays at the bottom, when there is one."""
        (self.bar.write if self.bar is not None else self.log)(text)

    def show(self, step: int, row: dict) -> None:
        """A logged step's metrics row."""
        if self.bar is None:
            self.log(step_line(step, self.steps, row))
            return
        self.bar.update(step - self.bar.n)
        moe = ({"load": f"{row['aux/max_over_mean_load']:.2f}"}
               if "aux/max_over_mean_load" in row else {})
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                             mfu=f"{row['mfu']:.1%}", **moe)

    def close(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.close()
