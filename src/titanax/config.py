"""Typed, frozen run configuration: one dataclass per section, validated once.

A run is described by `Config` (sections model, mesh, pipeline, train, optim, data, checkpoint).
It comes from a Python file defining `config()` or a gin file binding the section names
(`model.d_model = 256`), then `--set section.field=value` overrides. Every check that needs no
devices happens here, before anything is compiled, and each error names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import math
import pathlib
import re
import types
import typing
import warnings
from dataclasses import dataclass, field

from pallas_kernels.flash_attention.backends import BACKENDS as _ATTENTION_BACKENDS
from pallas_kernels.fp8.backends import MX_SCALE_ROUNDINGS as _MX_SCALE_ROUNDINGS
from pallas_kernels.fp8.backends import RECIPES as _FP8_RECIPES


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message says which field and how."""


def _fail(field_name: str, msg: str) -> None:
    raise ConfigError(f"{field_name}: {msg}")


def _check_choice(field_name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        _fail(field_name, f"{value!r} is not one of {list(choices)}.{hint}")


@functools.cache
def _type_hints(cls) -> dict[str, type]:
    # Resolving the string annotations is slow (they are compiled); the planner's search
    # builds thousands of configs.
    return typing.get_type_hints(cls)


def _check_types(section: str, obj) -> None:
    """Field types as declared (ints accepted for floats), whatever built the object: a Python
    config, gin, --set or a checkpoint's JSON."""
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        typ = hints[f.name]
        value = getattr(obj, f.name)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(obj, f.name, float(value))
            continue
        if typ is float and isinstance(value, float) and not math.isfinite(value):
            # optim.lr=nan trains NaN weights and saves them: no float knob means inf or nan.
            _fail(f"{section}.{f.name}", f"must be a finite number, got {value!r}")
        if isinstance(value, bool) and typ is not bool or not isinstance(value, typ):
            _fail(f"{section}.{f.name}", f"expected {_type_name(typ)}, got "
                  f"{type(value).__name__} {value!r}")


def _type_name(typ) -> str:
    return getattr(typ, "__name__", None) or str(typ)  # 'int | str' for a union


def _check_positive(section: str, obj, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            _fail(f"{section}.{name}", f"must be > 0, got {getattr(obj, name)}")


# Backend and recipe names come from the kernels' tables (plain data: no jax imported here).
# 'auto': pallas_kernels.flash_attention picks the kernel by GPU generation (xla on a CPU).
ATTENTION_IMPLS = (*_ATTENTION_BACKENDS, "auto")
# FP8 recipes (pallas_kernels/fp8): the attention projections and the MLP run FP8 GEMMs; the
# embedding, output layer, norms and softmax stay in model.dtype.
MATMUL_PRECISIONS = ("default", "highest", *_FP8_RECIPES)
MXFP8_SCALE_ROUNDINGS = _MX_SCALE_ROUNDINGS
DTYPES = ("float32", "bfloat16", "float16")
# full_offload: full remat whose saved layer inputs go to pinned host memory.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "full_offload")
ROPE_SCALINGS = ("none", "llama3")
GRAD_REDUCE_DTYPES = ("compute", "float32")
SOURCE_UNSET = "unset"  # data.source of a run that has none yet (an import)
GRAD_ACCUM_AUTO = "auto"  # train.grad_accum: the smallest count that fits (launch.train)
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")
CONTEXT_STRATEGIES = ("ring", "all_gather")
LR_SCHEDULES = ("cosine", "linear", "constant")


def parse_bytes(value: int | str) -> int:
    """A size in bytes from 123, '123', '80GB' (10^9) or '76.5GiB' (2^30); '' is 0."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)\s*", value.lower())
        if value.strip() and (not m or m[2] not in _SIZE_UNITS):
            raise ValueError(f"{value!r} is not a size: give bytes or e.g. '80GB', '76.5GiB'")
        n = int(float(m[1]) * _SIZE_UNITS[m[2]]) if value.strip() else 0
    if n < 0:
        raise ValueError(f"must be >= 0 (0: the devices' own), got {value!r}")
    return n


def _execution(default):
    """A ModelConfig field that says how the weights are computed, not what they are: a run may
    resume a checkpoint with another value (checkpoint/orbax_io.check_same_model compares the
    others). Where a value puts something in the train state (fp8_delayed's amax histories),
    the checkpoint check knows."""
    return field(default=default, metadata={"execution": True})


@dataclass(frozen=True)
class ModelConfig:
    # The architecture (a key of models/registry.py ARCHS), checked against the registry
    # when the model is built (config.py imports no model package). The fields below are its
    # dimensions; a preset (titanax.models.preset) sets them all, arch included.
    arch: str = "llama3"
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 0  # 0: d_model // n_heads
    ffn_dim: int = 768
    rope_theta: float = 500000.0
    # Llama 3.1 frequency scaling: long wavelengths divided by rope_factor, short ones kept,
    # a smooth blend between (models/layers.py rope_inv_freq).
    rope_scaling: str = "llama3"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    # The output layer is the input embedding transposed (Llama 3.2 1B/3B): no
    # separate 'output' parameter; HF export writes tie_word_embeddings and no lm_head.
    tie_embeddings: bool = False
    init_std: float = _execution(0.02)  # a new run's weights only
    attention_impl: str = _execution("xla")
    # With mesh.context > 1, how attention reaches the other devices' keys: 'ring' (K/V
    # blocks passed around with ppermute, each transfer hidden under the attention of the
    # block before) or 'all_gather' (K/V gathered once per layer: one collective instead of
    # context - 1 dependent ones; better for short local sequences and GQA's small K/V).
    context_strategy: str = _execution("ring")
    # Tensor-parallel overlap (TorchTitan's async TP, MaxText's collective matmul): with
    # mesh.tensor > 1, each sequence-parallel all-gather / reduce-scatter runs as tensor-ring
    # steps beside the column / row matmul's GEMMs (parallel/collective_matmul.py).
    tp_overlap: bool = _execution(False)
    matmul_precision: str = _execution("default")
    # Steps of amax history per tensor for fp8_delayed: Transformer Engine's DelayedScaling
    # default (amax_history_len=1024). Memory: 3 x 1024 float32 per FP8 call site per layer,
    # 7 sites: 84 KiB a layer, 6.7 MiB for Llama-3-70B's 80 layers (replicated, checkpointed).
    fp8_amax_history: int = _execution(1024)
    # mxfp8 scale exponents: 'up' (NVIDIA's / TE's MXFP8 recipe: ceil(log2(amax / 448)), the
    # block max is never clipped) or 'floor' (OCP MX v1.0: floor(log2 amax) - 8, may saturate
    # the block max by up to 12.5%).
    mxfp8_scale_rounding: str = _execution("up")
    dtype: str = _execution("bfloat16")  # compute
    param_dtype: str = "float32"  # master weights
    remat: str = _execution("none")
    # The dtype the weight gradients are summed and reduce-scattered in: 'compute' (the
    # backward's weight-gradient dots run in model.dtype, and XLA reduce-scatters them in it:
    # half the bytes) or 'float32' (summed and reduced in float32, TorchTitan's default; twice
    # the reduce-scatter traffic). FP8 recipes keep their own gradient dtypes.
    grad_reduce_dtype: str = _execution("compute")

    @classmethod
    def execution_fields(cls) -> tuple[str, ...]:
        """The fields a resumed run may change (_execution); the rest are the architecture."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("execution"))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def __post_init__(self):
        _check_types("model", self)
        if not self.arch:  # the name itself is checked by models/registry.model_spec
            _fail("model.arch", "must name an architecture (models/registry.py), e.g. llama3")
        _check_positive("model", self, "vocab_size", "d_model", "n_layers", "n_heads",
                        "n_kv_heads", "ffn_dim", "rope_theta", "max_seq_len", "norm_eps",
                        "fp8_amax_history")
        if self.head_dim < 0:
            _fail("model.head_dim", "must be >= 0 (0 means d_model // n_heads)")
        if self.head_dim == 0 and self.d_model % self.n_heads:
            _fail("model.d_model", f"{self.d_model} is not divisible by model.n_heads="
                  f"{self.n_heads}; change one of them or set model.head_dim explicitly")
        if self.resolved_head_dim % 2:
            _fail("model.head_dim", f"rotary embeddings need an even head dim, got "
                  f"{self.resolved_head_dim}")
        if self.n_heads % self.n_kv_heads:
            _fail("model.n_kv_heads", f"model.n_heads={self.n_heads} must be a multiple of "
                  f"model.n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        _check_choice("model.attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _check_choice("model.context_strategy", self.context_strategy, CONTEXT_STRATEGIES)
        _check_choice("model.matmul_precision", self.matmul_precision, MATMUL_PRECISIONS)
        _check_choice("model.mxfp8_scale_rounding", self.mxfp8_scale_rounding,
                      MXFP8_SCALE_ROUNDINGS)
        _check_choice("model.dtype", self.dtype, DTYPES)
        _check_choice("model.param_dtype", self.param_dtype, DTYPES)
        _check_choice("model.remat", self.remat, REMAT_POLICIES)
        _check_choice("model.grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        _check_choice("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling == "llama3":
            _check_positive("model", self, "rope_factor", "rope_low_freq_factor",
                            "rope_high_freq_factor", "rope_original_max_seq_len")
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                _fail("model.rope_high_freq_factor", "must be larger than "
                      "model.rope_low_freq_factor")


@dataclass(frozen=True)
class MeshConfig:
    # Degrees of each mesh axis; -1 takes whatever devices are left (at most one axis).
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1
    # Context parallelism: each sequence split over this many devices (load-balanced causal
    # chunks; parallel/context.py), attention exchanging K/V between them.
    # (model.context_strategy picks how attention exchanges K/V over it.)
    context: int = 1
    nvlink_domain: int = 0  # GPUs per NVLink domain; 0: devices per process

    def degrees(self) -> dict[str, int]:
        return {"pipeline": self.pipeline, "data": self.data, "fsdp": self.fsdp,
                "context": self.context, "tensor": self.tensor}

    def __post_init__(self):
        _check_types("mesh", self)
        degrees = self.degrees()
        for name, d in degrees.items():
            if d == 0 or d < -1:
                _fail(f"mesh.{name}", f"must be a positive degree or -1 (fill), got {d}")
        if sum(d == -1 for d in degrees.values()) > 1:
            _fail("mesh", "only one of data/fsdp/context/tensor/pipeline may be -1 (fill)")
        if self.nvlink_domain < 0:
            _fail("mesh.nvlink_domain", "must be >= 0 (0: devices per process)")


@dataclass(frozen=True)
class PipelineConfig:
    # Used when mesh.pipeline > 1 (see parallel/pipeline.py and docs/parallelism.md).
    microbatches: int = 1  # per pipelined forward/backward (per train.grad_accum microbatch)
    # gpipe: one layer chunk per stage, all forwards then all backwards; circular:
    # virtual_stages chunks per stage; 1f1b: gpipe's layout with forwards and backwards
    # interleaved, so a stage holds at most 2 x stages - 1 microbatches' activations
    # whatever pipeline.microbatches is.
    schedule: str = "gpipe"
    virtual_stages: int = 0  # layer chunks per stage; 0: 1 for gpipe, 2 for circular

    @property
    def resolved_virtual_stages(self) -> int:
        return self.virtual_stages or (2 if self.schedule == "circular" else 1)

    def __post_init__(self):
        _check_types("pipeline", self)
        _check_positive("pipeline", self, "microbatches")
        _check_choice("pipeline.schedule", self.schedule, PIPELINE_SCHEDULES)
        if self.virtual_stages < 0:
            _fail("pipeline.virtual_stages", "must be >= 0 (0: 1 for gpipe, 2 for circular)")
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages > 1:
            _fail("pipeline.virtual_stages", f"{self.virtual_stages} needs "
                  f"pipeline.schedule=circular ({self.schedule} runs one layer chunk per "
                  "stage)")
        if self.schedule == "circular" and self.virtual_stages == 1:
            _fail("pipeline.virtual_stages", "circular with one chunk per stage is gpipe; set "
                  "pipeline.virtual_stages >= 2 or pipeline.schedule=gpipe")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16  # global, in sequences
    seq_len: int = 256
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50  # 0: only at the start and end
    eval_batches: int = 8
    # Microbatches per optimizer step, summed inside the step. 'auto': launch.train compiles
    # the step for its devices and takes the smallest count whose memory fits them (the same
    # result: the step's gradient is the mean over the whole batch either way), and logs it;
    # when no count fits, the smallest change that does among those that keep the result
    # (titanax/plan/fit.py: a model.remat that saves more, and for a run whose optimizer is
    # in host memory the master weights too, train.offload_params), logged by name.
    grad_accum: int | str = 1
    # With grad_accum > 1 and model.remat='full'/'full_offload' (no pipeline): one float32
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
    progress_bar: bool = True
    # Steps with a non-finite loss or gradient are skipped (weights and optimizer state kept);
    # this many in a row stop the run: the model has diverged or the data is broken.
    max_bad_steps: int = 5
    # Host offload (train/offload.py) for when the train state does not fit in HBM: Adam's
    # moments, and with offload_params also the float32 master weights of the stacked decoder
    # layers, live in pinned host memory between steps and are streamed through the device
    # one layer at a time (the weights also in the forward and backward passes).
    offload_optimizer: bool = False
    offload_params: bool = False
    # Persistent XLA compilation cache: a resumed or requeued run loads its compiled programs
    # instead of compiling them again (minutes at 70B). "{workdir}" is the run folder: there
    # the cache sits with the checkpoints on the file system all nodes share (process 0
    # writes, every process reads) and goes away with the run; a user-level folder
    # (~/.cache/titanax/xla) is shared by all runs, if not by all nodes. "": no cache.
    compilation_cache: str = "{workdir}/xla_cache"
    # "START:END": a jax.profiler trace of the steps after START up to END (END - START
    # steps) in WORKDIR/profile, for TensorBoard's or Perfetto's trace viewer. "": none.
    profile_steps: str = ""

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """profile_steps as (START, END), or None."""
        if not self.profile_steps:
            return None
        start, end = self.profile_steps.split(":")
        return int(start), int(end)

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
        _check_types("train", self)
        if isinstance(self.grad_accum, str):
            object.__setattr__(self, "grad_accum", self.grad_accum.strip().lower())
            if not self.grad_accum_auto:
                _fail("train.grad_accum", f"expected a positive integer or 'auto', got "
                      f"{self.grad_accum!r}")
        try:
            parse_bytes(self.device_memory_limit)
        except ValueError as e:
            _fail("train.device_memory_limit", str(e))
        if self.profile_steps:
            m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", self.profile_steps)
            if not m or int(m[1]) >= int(m[2]):
                _fail("train.profile_steps", f"{self.profile_steps!r} is not START:END with "
                      "START < END (e.g. '10:15': the steps after 10 up to 15), or ''")
            object.__setattr__(self, "profile_steps", f"{int(m[1])}:{int(m[2])}")
        _check_positive("train", self, "steps", "batch_size", "seq_len", "log_every",
                        "eval_batches", "max_bad_steps")
        if self.known_grad_accum <= 0:
            _fail("train.grad_accum", f"must be > 0 or 'auto', got {self.grad_accum}")
        if self.eval_every < 0:
            _fail("train.eval_every", "must be >= 0")
        if self.peak_flops < 0:
            _fail("train.peak_flops", "must be >= 0 (0: measure or look up)")
        if self.loss_chunk < 0:
            _fail("train.loss_chunk", "must be >= 0 (tokens per device per chunk; 0: no "
                  "chunking)")
        if self.batch_size % self.known_grad_accum:
            _fail("train.grad_accum", f"train.batch_size={self.batch_size} must be divisible "
                  f"by train.grad_accum={self.grad_accum}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 30
    # > 0: the warmup is this share of the decay steps (train.steps unless optim.decay_steps),
    # in place of warmup_steps, so it follows a train.steps given later (MaxText's
    # warmup_steps_fraction; the fine-tuning recipe of launch.import_hf takes 3%).
    warmup_fraction: float = 0.0
    schedule: str = "cosine"
    decay_steps: int = 0  # 0: train.steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0: no clipping

    def __post_init__(self):
        _check_types("optim", self)
        _check_positive("optim", self, "lr", "eps")
        _check_choice("optim.schedule", self.schedule, LR_SCHEDULES)
        for name in ("warmup_steps", "decay_steps", "weight_decay", "clip_norm"):
            if getattr(self, name) < 0:
                _fail(f"optim.{name}", f"must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail("optim.min_lr_ratio", f"must lie in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            _fail("optim.warmup_fraction", f"must lie in [0, 1), got {self.warmup_fraction}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(f"optim.{name}", f"must lie in [0, 1), got {getattr(self, name)}")


@dataclass(frozen=True)
class DataConfig:
    # 'embedded' (the Python standard library's sources), 'synthetic' (random tokens, for
    # benchmarks), a folder of token shards written by `python -m launch.prepare_data`, or a
    # weighted mixture of such folders: 'a:0.7,b:0.3' (a Python config may give
    # [("a", 0.7), ("b", 0.3)]; it is stored as the string, so checkpoints and --set agree).
    # 'unset' (SOURCE_UNSET): none given yet (launch.import_hf writes it: an imported model
    # has no data of its own); launch.train refuses to start until one is.
    source: str = "embedded"
    tokenizer: str = ""  # tokenizer.json; '' with embedded: trained on first use, cached
    val_fraction: float = 0.02  # held-out share of documents (embedded) or tokens (shards)
    embedded_max_bytes: int = 24_000_000  # cap on the embedded corpus read from disk
    document_masking: bool = True  # attention never crosses packed document boundaries
    shuffle: bool = True
    # Each document starts with the tokenizer's BOS token (as in Llama 3 pretraining); a shard
    # folder records whether it was written with `prepare_data --bos`, and must agree.
    bos: bool = False
    # A shard folder whose prepare_data was interrupted (meta.json complete: false) trains
    # only with this set: its validation split is the tail of what is there so far, and
    # moves once the folder is finished.
    allow_partial: bool = False

    def __post_init__(self):
        if isinstance(self.source, (list, tuple, dict)):
            object.__setattr__(self, "source", _mixture_string(self.source))
        _check_types("data", self)
        if not self.source:
            _fail("data.source", "must be 'embedded', 'synthetic' or a folder of token shards")
        self.folders()  # a malformed mixture fails here, before anything is built
        if not 0.0 < self.val_fraction < 0.5:
            _fail("data.val_fraction", f"must lie in (0, 0.5), got {self.val_fraction}")
        _check_positive("data", self, "embedded_max_bytes")

    @property
    def masks_documents(self) -> bool:
        """Whether the train step passes segment ids to attention: document_masking, unless
        the source has no documents (synthetic random tokens: every row is one segment, and
        all-equal ids would only send attention down the masked path of a packed-document
        kernel for nothing)."""
        return self.document_masking and self.source != "synthetic"

    def folders(self) -> list[tuple[str, float]]:
        """(folder, weight) per shard folder of data.source: [] for embedded/synthetic, one
        entry (weight 1.0) for a plain folder, several for a mixture (weights as written)."""
        return parse_source(self.source)


def _mixture_string(pairs) -> str:
    """[("a", 0.7), ("b", 0.3)] or {"a": 0.7, "b": 0.3} -> 'a:0.7,b:0.3' (data.source)."""
    items = list(pairs.items()) if isinstance(pairs, dict) else list(pairs)
    parts = []
    for item in items:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not isinstance(item[0], str) or isinstance(item[1], bool)
                or not isinstance(item[1], (int, float))):
            _fail("data.source", f"mixture entry {item!r} is not a (folder, weight) pair; write "
                  "e.g. [('shards/web', 0.7), ('shards/code', 0.3)]")
        parts.append(f"{item[0]}:{float(item[1])!r}")
    return ",".join(parts)


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_source(source: str) -> list[tuple[str, float]]:
    """data.source -> [(folder, weight), ...]; see DataConfig.folders."""
    if source in ("embedded", "synthetic", SOURCE_UNSET):
        return []
    items = [item.strip() for item in source.split(",")]
    split = [item.rpartition(":") for item in items]
    weighted = [sep and _weight(w) is not None for _, sep, w in split]
    if not any(weighted):  # no 'folder:weight' at all: one folder (its name may hold ',')
        return [(source, 1.0)]
    pairs = []
    for item, (folder, _, w), ok in zip(items, split, weighted):
        weight = _weight(w) if ok else None
        if not ok or not folder or weight is None or not math.isfinite(weight) or weight <= 0:
            _fail("data.source", f"mixture entry {item!r} is not folder:weight with a weight "
                  "> 0; write e.g. data.source=shards/web:0.7,shards/code:0.3")
        if folder in ("embedded", "synthetic"):
            _fail("data.source", f"a mixture is of token shard folders, not {folder!r}; write "
                  "the text with `python -m launch.prepare_data` and mix the folder")
        if folder in [f for f, _ in pairs]:
            _fail("data.source", f"{folder!r} appears twice in the mixture; give it once, "
                  "with the sum of its weights")
        pairs.append((folder, weight))
    return pairs


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 100  # 0: only at the end
    keep: int = 3
    async_save: bool = True
    restore: str = ""  # another run's workdir, checkpoints/ folder or step folder to start from
    permanent_every: int = 0  # also keep every step divisible by this for good; 0: off

    def __post_init__(self):
        _check_types("checkpoint", self)
        if self.every_steps < 0:
            _fail("checkpoint.every_steps", "must be >= 0 (0: only at the end)")
        _check_positive("checkpoint", self, "keep")
        if self.permanent_every < 0:
            _fail("checkpoint.permanent_every", "must be >= 0 (0: off)")
        if self.permanent_every and self.every_steps and self.permanent_every % self.every_steps:
            _fail("checkpoint.permanent_every", f"{self.permanent_every} is not a multiple of "
                  f"checkpoint.every_steps={self.every_steps}, so those steps are never saved")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                _fail(name, f"must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if self.train.seq_len > self.model.max_seq_len:
            _fail("train.seq_len", f"{self.train.seq_len} exceeds model.max_seq_len="
                  f"{self.model.max_seq_len}; raise model.max_seq_len or shorten the sequence")
        if self.train.offload_params and self.model.remat == "none":
            _fail("train.offload_params", "needs a model.remat policy: without one the "
                  "backward pass keeps every layer's weights on the device, the very copy "
                  "offloading avoids; set model.remat=full (or full_offload, dots, "
                  "dots_no_batch)")
        t = self.train
        if t.offload_params and (t.grad_accum_auto or t.grad_accum > 1):
            # The sum in place (models/accumulate.py) takes each layer's gradients on the
            # device as its backward makes them; the plain sum would meet them in host memory.
            if not t.grad_accum_in_place:
                _fail("train.offload_params", f"with train.grad_accum={t.grad_accum} needs "
                      "train.grad_accum_in_place=true: the plain sum would add the offloaded "
                      "layers' gradients in host memory, where it cannot run")
            if self.model.remat not in ("full", "full_offload"):
                _fail("train.offload_params", f"with train.grad_accum={t.grad_accum} needs "
                      f"model.remat=full or full_offload (got {self.model.remat!r}): the "
                      "gradients are summed in place only under those; or set "
                      "train.grad_accum=1")
        check_parallel_layout(self, self.mesh.degrees())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        kwargs = {}
        for name, section_cls in SECTIONS.items():
            values = dict(d.get(name, {}))
            known = {f.name for f in dataclasses.fields(section_cls)}
            kwargs[name] = section_cls(**{k: v for k, v in values.items() if k in known})
        return cls(**kwargs)


def check_parallel_layout(cfg: Config, degrees: dict[str, int]) -> None:
    """Model and batch sizes against mesh degrees (-1: not known yet, skipped). Runs here with
    the configured degrees and again in parallel/mesh.py once -1 is resolved."""
    m, tensor, pp = cfg.model, degrees["tensor"], degrees["pipeline"]
    if pp == -1 and cfg.pipeline.schedule == "circular":
        _fail("mesh.pipeline", "-1 with pipeline.schedule=circular: circular runs store the "
              "layer stack stage-major for their stage count, so set mesh.pipeline explicitly")
    if tensor > 0:
        for name in ("n_heads", "n_kv_heads"):
            if getattr(m, name) % tensor:
                _fail(f"model.{name}", f"{getattr(m, name)} is not divisible by mesh.tensor="
                      f"{tensor} (tensor parallelism splits heads); choose mesh.tensor dividing "
                      f"{getattr(m, name)}")
        if cfg.train.seq_len % tensor:
            _fail("train.seq_len", f"{cfg.train.seq_len} is not divisible by mesh.tensor="
                  f"{tensor} (sequence parallelism splits the norm regions along the sequence)")
    _check_context(cfg, degrees.get("context", 1), max(tensor, 1), pp)
    if cfg.model.tp_overlap:
        why = tp_overlap_unsupported(cfg, degrees)
        if why:
            _fail("model.tp_overlap", why)
    if pp > 1 and cfg.train.offload_params:
        _fail("train.offload_params", f"does not work with mesh.pipeline={pp}: the pipeline "
              "schedules pick each stage's layer chunk with a traced index, which XLA cannot "
              "do on weights in host memory; use mesh.pipeline=1 (fsdp/data/tensor) or "
              "train.offload_optimizer alone")
    if pp > 1:
        v = cfg.pipeline.resolved_virtual_stages
        if m.n_layers % (pp * v):
            _fail("model.n_layers", f"{m.n_layers} layers do not split into mesh.pipeline={pp} "
                  f"stages x pipeline.virtual_stages={v} equal chunks; make n_layers a multiple "
                  f"of {pp * v}")
        micro = cfg.pipeline.microbatches
        rows = cfg.train.batch_size // cfg.train.known_grad_accum
        if rows % micro:
            _fail("pipeline.microbatches", f"{micro} does not divide the {rows} sequences of a "
                  "step (train.batch_size / train.grad_accum)")
        if cfg.pipeline.schedule == "circular" and micro < pp:
            _fail("pipeline.microbatches", f"the circular schedule needs at least as many "
                  f"microbatches as stages (mesh.pipeline={pp}), got {micro}")
        if cfg.pipeline.schedule == "1f1b" and m.matmul_precision == "fp8_delayed":
            _fail("pipeline.schedule", "1f1b computes gradients inside its schedule, where "
                  "fp8_delayed's amax histories (carried as gradients) cannot pass; use "
                  "model.matmul_precision=fp8_tensorwise or pipeline.schedule=gpipe")
    if degrees["data"] > 0 and degrees["fsdp"] > 0:
        ways = degrees["data"] * degrees["fsdp"]
        micro = cfg.pipeline.microbatches if pp > 1 else 1
        rows = cfg.train.batch_size // (cfg.train.known_grad_accum * micro)
        if cfg.train.batch_size % ways or rows % ways:
            _fail("train.batch_size", f"{cfg.train.batch_size} sequences in microbatches of "
                  f"{rows} (grad_accum={cfg.train.grad_accum}, pipeline microbatches={micro}) "
                  f"do not split over mesh data x fsdp = {ways}; make each microbatch a "
                  f"multiple of {ways}")


def grad_accum_in_place_unsupported(cfg: Config) -> str | None:
    """Why a step of cfg sums its microbatches' gradients the plain way, or None: in place
    (models/accumulate.py, whose `unsupported` this is; the memory model reads it too)."""
    t = cfg.train
    if t.grad_accum == 1:
        return "train.grad_accum=1: nothing to accumulate"
    if not t.grad_accum_in_place:
        return "train.grad_accum_in_place=False"
    if cfg.model.remat not in ("full", "full_offload"):
        return (f"model.remat={cfg.model.remat!r}: the in-place backward recomputes each layer "
                "from its input, which is model.remat='full' (or 'full_offload')")
    if cfg.mesh.pipeline > 1:
        return "pipeline parallelism: the stages run their own backward schedule"
    return None


def tp_overlap_unsupported(cfg: Config, degrees: dict[str, int]) -> str | None:
    """Why model.tp_overlap cannot run on cfg with these mesh degrees, or None. Shared with
    parallel/collective_matmul.unsupported (this module imports no jax). mesh.tensor=1 (or
    not known yet: checked again once resolved) has no tensor ring, so nothing to refuse."""
    if degrees["tensor"] in (1, -1):
        return None
    if degrees["pipeline"] != 1 and cfg.pipeline.schedule == "1f1b":
        return ("pipeline.schedule=1f1b runs each stage's layers under lax.cond, so a ring's "
                "collective-permutes would run on some stages only (XLA:CPU's permute waits for "
                "every device and mixes up ticks; on GPU the communicator set-up is collective "
                "too); use pipeline.schedule=gpipe or circular, or set model.tp_overlap=false")
    if cfg.model.matmul_precision in _FP8_RECIPES:
        return (f"model.matmul_precision={cfg.model.matmul_precision} runs the projections as "
                "FP8 GEMMs (pallas_kernels/fp8), which the collective matmul does not cut into "
                "ring steps: the tensor-parallel collectives would stay whole and exposed; "
                "use model.matmul_precision=default (or highest), or set "
                "model.tp_overlap=false")
    return None


def _check_context(cfg: Config, cp: int, tensor: int, pp: int) -> None:
    if cp in (-1, 1):
        return
    seq = cfg.train.seq_len
    if seq % (2 * cp) or seq % (cp * tensor):
        need = math.lcm(2 * cp, cp * tensor)
        _fail("train.seq_len", f"{seq} does not split over mesh.context={cp}: each device "
              f"holds two chunks of seq_len / (2 x context) tokens (one from the start, one "
              f"from the end, for causal load balance), split again over mesh.tensor="
              f"{tensor}; make train.seq_len a multiple of {need}")
    if cfg.pipeline.schedule == "1f1b" and pp != 1:
        _fail("pipeline.schedule", f"1f1b with mesh.context={cp}: its stages run forward and "
              "backward ticks under stage-dependent branches, and the K/V exchange of "
              "context parallelism cannot sit inside them (the collectives of different "
              "branches would meet); use pipeline.schedule=gpipe or circular")
    if cfg.model.attention_impl == "cudnn":
        _fail("model.attention_impl", "cudnn cannot run context parallelism (its attention "
              "does not compile inside the shard_map the K/V exchange runs in); use auto, "
              "xla or one of our kernels (triton, mosaic_sm90, mosaic_sm100)")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "mesh": MeshConfig,
    "pipeline": PipelineConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
}


# --- overrides -------------------------------------------------------------------------------

def _field_types(cls) -> dict[str, type]:
    hints = _type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _closest_key(key: str) -> str:
    section, _, name = key.partition(".")
    if section in SECTIONS:  # a known section: the field is the likely typo
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        if close:
            return f" Did you mean '{section}.{close[0]}'?"
    all_keys = [f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c)]
    close = difflib.get_close_matches(key, all_keys, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _coerce(key: str, raw, typ: type):
    """Turns an override value (a string from the command line, or a Python value) into typ."""
    if isinstance(typ, types.UnionType):  # int | str (train.grad_accum=4 or auto): a number
        if isinstance(raw, str):          # when it reads as one, else the text
            try:
                return _coerce(key, raw, int)
            except ConfigError:
                return raw.strip()
        if isinstance(raw, bool) or not isinstance(raw, typ):
            raise ConfigError(f"{key}: expected {_type_name(typ)}, got {type(raw).__name__} "
                              f"{raw!r}")
        return raw
    if isinstance(raw, str):
        text = raw.strip()
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{key}: expected a boolean (true/false), got {raw!r}")
        if typ is int:
            try:
                return int(text.replace("_", ""))
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    raise ConfigError(f"{key}: expected an integer, got {raw!r}") from None
                if value.is_integer():
                    return int(value)
                raise ConfigError(f"{key}: expected an integer, got {raw!r}") from None
        if typ is float:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {raw!r}") from None
        if typ is str:
            return text
    if typ is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if typ is bool and not isinstance(raw, bool):
        raise ConfigError(f"{key}: expected a boolean, got {type(raw).__name__} {raw!r}")
    if typ in (int, float) and isinstance(raw, bool):
        raise ConfigError(f"{key}: expected {typ.__name__}, got a boolean")
    if not isinstance(raw, typ):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {type(raw).__name__} {raw!r}")
    if typ is float and not math.isfinite(raw):
        raise ConfigError(f"{key}: must be a finite number, got {raw!r}")
    return raw


def parse_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.field=value, e.g. train.steps=100")
    key, value = text.split("=", 1)
    return key.strip(), value


def apply_overrides(cfg: Config, overrides: typing.Mapping[str, typing.Any] | typing.Iterable[str]) -> Config:
    """Applies {'train.steps': '300'} or ['train.steps=300'] to cfg; validates the result."""
    if not isinstance(overrides, typing.Mapping):
        overrides = dict(parse_override(o) for o in overrides)
    per_section: dict[str, dict] = {}
    for key, raw in overrides.items():
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in SECTIONS:
            raise ConfigError(f"unknown config key {key!r}: keys look like section.field with "
                              f"section one of {list(SECTIONS)}.{_closest_key(key)}")
        section, name = parts
        types_ = _field_types(SECTIONS[section])
        if name not in types_:
            raise ConfigError(f"unknown config key {key!r}.{_closest_key(key)}")
        per_section.setdefault(section, {})[name] = _coerce(key, raw, types_[name])
    sections = {s: dataclasses.replace(getattr(cfg, s), **v) for s, v in per_section.items()}
    return dataclasses.replace(cfg, **sections)


# --- files -----------------------------------------------------------------------------------

def _load_py(path: pathlib.Path) -> Config:
    spec = importlib.util.spec_from_file_location(f"titanax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "config"):
            raise ConfigError(f"{path}: a Python config must define config() returning "
                              "titanax.config.Config")
        cfg = module.config()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's file: one line naming where it broke
        raise ConfigError(f"{path}{_where_in(e, path)}: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: config() returned {type(cfg).__name__}, expected "
                          "titanax.config.Config")
    return cfg


def _where_in(e: BaseException, path: pathlib.Path) -> str:
    """':LINE' of the deepest frame of e's traceback inside path ('' when none is)."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f":{e.lineno}"
    line = ""
    tb = e.__traceback__
    while tb is not None:
        if pathlib.Path(tb.tb_frame.f_code.co_filename).resolve() == path.resolve():
            line = f":{tb.tb_lineno}"
        tb = tb.tb_next
    return line


def _load_gin(path: pathlib.Path) -> Config:
    import tokenize

    import gin

    gin.clear_config()
    configurables = {}
    for name, cls in SECTIONS.items():
        configurables[name] = gin.external_configurable(cls, name=name, module="titanax")
    try:
        gin.parse_config_file(str(path), skip_unknown=False)
    except SyntaxError as e:  # gin's parser: a malformed statement or value
        raise ConfigError(f"{path}:{e.lineno}: {e.msg}") from None
    except tokenize.TokenError as e:  # Python's tokenizer under gin: unclosed bracket or quote
        line = e.args[1][0] if len(e.args) > 1 else "?"
        raise ConfigError(f"{path}:{line}: {e.args[0]}") from None
    except (ValueError, KeyError) as e:  # gin's messages name the binding; add the closest key
        msg = str(e)
        hint = ""
        quoted = re.findall(r"'([\w.]+)'", msg)  # gin quotes the configurable, then the parameter
        if len(quoted) >= 2 and quoted[0] in SECTIONS:
            hint = _closest_key(f"{quoted[0]}.{quoted[1]}")
        elif quoted and quoted[0] not in SECTIONS:
            close = difflib.get_close_matches(quoted[0], list(SECTIONS), n=1)
            hint = f" Sections are {list(SECTIONS)}." + (f" Did you mean {close[0]!r}?" if close else "")
        raise ConfigError(f"{path}: {msg.splitlines()[0]}{hint}") from None
    try:
        return Config(**{name: make() for name, make in configurables.items()})
    except ConfigError as e:  # gin appends "In call to configurable ..." lines; keep ours
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    finally:
        gin.clear_config()


def _load_json(p: pathlib.Path) -> Config:
    """A run's config.json (what launch.train and the HF import write into a workdir): the
    sections as Config.to_dict() gives them. Fields this version does not know (a run of
    another version) are left out with a warning naming them."""
    try:
        d = json.loads(p.read_text())
    except ValueError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(d, dict) or not d or set(d) - set(SECTIONS):
        extra = sorted(set(d) - set(SECTIONS)) if isinstance(d, dict) else type(d).__name__
        raise ConfigError(f"config file {str(p)!r}: expected a run's config.json, an object "
                          f"of the sections {', '.join(SECTIONS)}; got {extra or 'nothing'}")
    unknown = [f"{name}.{k}" for name, section_cls in SECTIONS.items()
               for k in (d.get(name) or {})
               if k not in {f.name for f in dataclasses.fields(section_cls)}]
    if unknown:
        warnings.warn(f"{p}: fields this titanax does not have, left out: {', '.join(unknown)}",
                      stacklevel=3)
    try:
        return Config.from_dict(d)
    except TypeError as e:
        raise ConfigError(f"config file {str(p)!r}: {e}") from None


def load_config(path: str | pathlib.Path | None = None,
                overrides: typing.Iterable[str] | typing.Mapping[str, typing.Any] = ()) -> Config:
    """Reads a .py (defining config()) or .gin file, or a run's config.json, then applies --set
    overrides."""
    if path is None:
        cfg = Config()
    else:
        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist (configs/ has tiny.py, "
                              "llama3_8b.py, llama3_70b.py, llama3_405b.py and .gin twins)")
        if p.suffix == ".py":
            cfg = _load_py(p)
        elif p.suffix == ".gin":
            cfg = _load_gin(p)
        elif p.suffix == ".json":
            cfg = _load_json(p)
        else:
            raise ConfigError(f"config file {str(p)!r}: expected a .py or .gin file, or a "
                              "run's config.json")
    try:
        return apply_overrides(cfg, overrides)
    except TypeError as e:  # dataclasses.replace with a wrong type slips through as TypeError
        raise ConfigError(str(e)) from None


def format_config(cfg: Config) -> str:
    lines = []
    for name in SECTIONS:
        section = getattr(cfg, name)
        vals = ", ".join(f"{f.name}={getattr(section, f.name)!r}" for f in dataclasses.fields(section))
        lines.append(f"  {name}: {vals}")
    return "\n".join(lines)


__all__ = ["Config", "ConfigError", "ModelConfig", "MeshConfig", "PipelineConfig", "TrainConfig",
           "OptimConfig", "DataConfig", "CheckpointConfig", "SECTIONS", "load_config",
           "apply_overrides", "format_config", "parse_override"]
