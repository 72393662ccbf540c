"""The train section: steps, batch, accumulation, logging, memory limits, host offload."""

from __future__ import annotations

import re
from dataclasses import dataclass

from titanax.config.errors import check_choice, check_positive, check_types, fail
from titanax.config.sizes import parse_bytes
from titanax.loggers import DEFAULT_LOGGERS, LOGGERS, REQUIRED_LOGGER

GRAD_ACCUM_AUTO = "auto"  # train.grad_accum: the smallest count that fits (launch.train)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300  # optimizer steps to train (the end of the run)
    # Passes over the training data instead of a step count: > 0 sets train.steps to
    # ceil(epochs x training rows / batch_size) once the data is open (launch.train logs the
    # count; the learning-rate schedule spans it). Fractions allowed (0.5: half the data).
    # 0: train.steps decides. Not for data.source=synthetic (no end).
    epochs: float = 0.0
    batch_size: int = 16  # global, in sequences
    seq_len: int = 256  # tokens per sequence (<= model.max_seq_len)
    seed: int = 0  # initial weights and data order
    log_every: int = 10  # steps between metrics.jsonl rows and log lines
    eval_every: int = 50  # 0: only at the start and end
    eval_batches: int = 8  # validation batches per evaluation
    # Microbatches per optimizer step, summed inside the step. 'auto': launch.train compiles
    # the step for its devices and takes the smallest count whose memory fits them (the same
    # result: the step's gradient is the mean over the whole batch either way), and logs it;
    # when no count fits, the smallest change that does among those that keep the result
    # (titanax/plan/fit.py: a execution.remat that saves more, and for a run whose optimizer is
    # in host memory the master weights too, train.offload_params), logged by name.
    grad_accum: int | str = 1
    # With grad_accum > 1 and execution.remat='full'/'full_offload' (no pipeline): one float32
    # gradient buffer for all microbatches, each layer's gradients added into it by the
    # backward pass (models/accumulate.py). False: the plain sum (the sum beside each
    # microbatch's fresh gradients), for comparison.
    grad_accum_in_place: bool = True
    # The memory per device the compiled train step must fit in; launch.train checks it
    # before the first step and names the --set that fits. '' or 0: the devices' own (the
    # GPU allocator's limit; none on a CPU); else bytes or a size, '80GB', '76.5GiB'.
    device_memory_limit: int | str = ""
    # Tokens per device whose output-layer logits exist at once: the output layer and the
    # cross-entropy run fused, chunked over the sequence (ops/cross_entropy.py), so no
    # [batch, seq, vocab] float32 tensor is ever held. 0: one chunk per step (microbatch).
    # 1024: ~1.3 GB of logits (float32 and their gradient) per chunk for Llama 3's vocabulary,
    # GEMMs still 1024 rows tall; on a CPU smaller chunks stay in cache (6% faster step,
    # docs/performance.md).
    loss_chunk: int = 1024
    # Peak FLOP/s per device for MFU. 0: look the device up in hardware.py, or on CPU
    # measure it once with a matmul probe at start.
    peak_flops: float = 0.0
    progress_bar: bool = True  # a tqdm bar on a terminal (log lines either way)
    # Steps with a non-finite loss or gradient are skipped (weights and optimizer state kept);
    # this many in a row stop the run: the model has diverged or the data is broken.
    max_bad_steps: int = 5
    # Host offload (train/offload.py) for when the train state does not fit in HBM: Adam's
    # moments, and with offload_params also the float32 master weights of the stacked decoder
    # layers, live in pinned host memory between steps and are streamed through the device
    # one layer at a time (the weights also in the forward and backward passes).
    offload_optimizer: bool = False
    offload_params: bool = False  # the weights in pinned host memory, fetched per layer
    # Persistent XLA compilation cache: a resumed or requeued run loads its compiled programs
    # instead of compiling them again (minutes at 70B). "{workdir}" is the run folder: there
    # the cache sits with the checkpoints on the file system all nodes share (process 0
    # writes, every process reads) and goes away with the run; a user-level folder
    # (~/.cache/titanax/xla) is shared by all runs, if not by all nodes. "": no cache.
    compilation_cache: str = "{workdir}/xla_cache"
    # "START:END": a jax.profiler trace of the steps after START up to END (END - START
    # steps) in WORKDIR/profile, for TensorBoard's or Perfetto's trace viewer. "": none.
    profile_steps: str = ""
    # Where the metrics rows go, comma-separated: jsonl (required), tensorboard, wandb, mlflow.
    # jsonl: WORKDIR/metrics.jsonl; tensorboard: WORKDIR/tb; wandb and mlflow are optional
    # extras (pip install 'titanax[wandb]') set up by their own environment variables
    # (docs/monitoring.md). The names and their classes: titanax/loggers.py.
    loggers: str = DEFAULT_LOGGERS

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """profile_steps as (START, END), or None."""
        if not self.profile_steps:
            return None
        start, end = self.profile_steps.split(":")
        return int(start), int(end)

    @property
    def logger_names(self) -> tuple[str, ...]:
        """loggers as a tuple of names, in order."""
        return tuple(self.loggers.split(","))

    @property
    def grad_accum_auto(self) -> bool:
        return self.grad_accum == GRAD_ACCUM_AUTO

    @property
    def known_grad_accum(self) -> int:
        """grad_accum, or 1 for 'auto' (what checks needing a number assume; auto's choice is
        validated again once made)."""
        return 1 if self.grad_accum_auto else self.grad_accum

    @property
    def device_memory_limit_bytes(self) -> int:
        """device_memory_limit in bytes; 0: the devices' own."""
        return parse_bytes(self.device_memory_limit)

    def __post_init__(self):
        if isinstance(self.loggers, (list, tuple)):  # a Python config may list the names
            object.__setattr__(self, "loggers", ",".join(map(str, self.loggers)))
        check_types("train", self)
        self._check_loggers()
        if isinstance(self.grad_accum, str):
            object.__setattr__(self, "grad_accum", self.grad_accum.strip().lower())
            if not self.grad_accum_auto:
                fail("train.grad_accum", f"expected a positive integer or 'auto', got "
                     f"{self.grad_accum!r}")
        try:
            parse_bytes(self.device_memory_limit)
        except ValueError as e:
            fail("train.device_memory_limit", str(e))
        if self.profile_steps:
            m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", self.profile_steps)
            if not m or int(m[1]) >= int(m[2]):
                fail("train.profile_steps", f"{self.profile_steps!r} is not START:END with "
                     "START < END (e.g. '10:15': the steps after 10 up to 15), or ''")
            object.__setattr__(self, "profile_steps", f"{int(m[1])}:{int(m[2])}")
        check_positive("train", self, "steps", "batch_size", "seq_len", "log_every",
                       "eval_batches", "max_bad_steps")
        if self.known_grad_accum <= 0:
            fail("train.grad_accum", f"must be > 0 or 'auto', got {self.grad_accum}")
        if self.epochs < 0:
            fail("train.epochs", f"must be >= 0 (0: train.steps decides), got {self.epochs}")
        if self.eval_every < 0:
            fail("train.eval_every", "must be >= 0")
        if self.peak_flops < 0:
            fail("train.peak_flops", "must be >= 0 (0: measure or look up)")
        if self.loss_chunk < 0:
            fail("train.loss_chunk", "must be >= 0 (tokens per device per chunk; 0: no "
                 "chunking)")
        if self.batch_size % self.known_grad_accum:
            fail("train.grad_accum", f"train.batch_size={self.batch_size} must be divisible "
                 f"by train.grad_accum={self.grad_accum}")

    def _check_loggers(self) -> None:
        """Known names, jsonl among them; stored normalised ('jsonl,wandb'), each once."""
        names = [n.strip().lower() for n in self.loggers.split(",") if n.strip()]
        for name in names:
            check_choice("train.loggers", name, tuple(LOGGERS))
        if REQUIRED_LOGGER not in names:
            fail("train.loggers", f"{self.loggers!r} lacks {REQUIRED_LOGGER!r}: metrics.jsonl "
                 "is what loss.png, launch.plot_runs and a resume's trimming read; add it "
                 f"(e.g. '{','.join([REQUIRED_LOGGER, *names])}')")
        object.__setattr__(self, "loggers", ",".join(dict.fromkeys(names)))
