"""The whole run's Config and the checks that read more than one section: sizes against mesh
degrees, which combinations of offload, accumulation, pipeline and context parallelism run.
check_parallel_layout runs here with the configured degrees and again in parallel/mesh.py
once -1 is resolved; the `*_unsupported` reasons are shared with the code that runs them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pallas_kernels.flash_attention.backends import BACKENDS as ATTENTION_BACKENDS
from titanax.config.checkpoint import CheckpointConfig
from titanax.config.data import DataConfig
from titanax.config.errors import fail
from titanax.config.execution import FP8_RECIPES, ExecutionConfig
from titanax.config.lora import LoraConfig
from titanax.config.model import (
    EXECUTION_FIELDS,
    ModelConfig,
    arch_config_class,
    as_arch_class,
    model_field_names,
    old_execution_values,
)
from titanax.config.optim import OptimConfig
from titanax.config.parallel import BATCH_AXES, MeshConfig, PipelineConfig, batch_ways
from titanax.config.train import TrainConfig

SECTIONS: dict[str, type] = {
    "model": ModelConfig,  # an instance of the architecture's subclass (model.arch)
    "execution": ExecutionConfig,
    "mesh": MeshConfig,
    "pipeline": PipelineConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "lora": LoraConfig,
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                fail(name, f"must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        _settle_model_and_execution(self)
        if self.train.seq_len > self.model.max_seq_len:
            fail("train.seq_len", f"{self.train.seq_len} exceeds model.max_seq_len="
                 f"{self.model.max_seq_len}; raise model.max_seq_len or shorten the sequence")
        if self.train.epochs and self.data.source == "synthetic":
            fail("train.epochs", "data.source=synthetic has no end to count passes over; "
                 "set train.steps instead (and train.epochs=0)")
        if self.train.offload_params and self.execution.remat == "none":
            fail("train.offload_params", "needs a execution.remat policy: without one the "
                 "backward pass keeps every layer's weights on the device, the very copy "
                 "offloading avoids; set execution.remat=full (or full_offload, dots, "
                 "dots_no_batch)")
        t = self.train
        if t.offload_params and (t.grad_accum_auto or t.grad_accum > 1):
            # The sum in place (models/accumulate.py) takes each layer's gradients on the
            # device as its backward makes them; the plain sum would meet them in host memory.
            if not t.grad_accum_in_place:
                fail("train.offload_params", f"with train.grad_accum={t.grad_accum} needs "
                     "train.grad_accum_in_place=true: the plain sum would add the offloaded "
                     "layers' gradients in host memory, where it cannot run")
            if self.execution.remat not in ("full", "full_offload"):
                fail("train.offload_params", f"with train.grad_accum={t.grad_accum} needs "
                     f"execution.remat=full or full_offload (got {self.execution.remat!r}): the "
                     "gradients are summed in place only under those; or set "
                     "train.grad_accum=1")
        # Each section refuses what it cannot run with yet (config/lora.py, and the model
        # section's class: config/moe.py for a mixture of experts).
        self.lora.check_run(self)
        self.model.check_run(self)
        check_parallel_layout(self, self.mesh.degrees())

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """A Config from to_dict()'s sections; fields this version does not have are left out
        (config/loading.py warns about them). Written before the execution section existed,
        a dict carries its fields under model: they move to execution."""
        d = sections_of_old_dict(d)
        arch = (d.get("model") or {}).get("arch", ModelConfig.arch)
        kwargs = {}
        for name, section_cls in SECTIONS.items():
            values = dict(d.get(name) or {})
            known = (model_field_names(arch) if name == "model" else
                     {f.name for f in dataclasses.fields(section_cls)})
            kwargs[name] = {k: v for k, v in values.items() if k in known}
        model_cls = arch_config_class(arch)
        return cls(**{name: (model_cls if name == "model" else SECTIONS[name])(**values)
                      for name, values in kwargs.items()})


def sections_of_old_dict(d: dict) -> dict:
    """d with execution fields found under model (configs written before the execution
    section) moved to execution; a value execution also sets wins."""
    model = dict(d.get("model") or {})
    moved = {k: model.pop(k) for k in EXECUTION_FIELDS if k in model}
    return {**d, "model": model, "execution": {**moved, **(d.get("execution") or {})}}


def _settle_model_and_execution(cfg: Config) -> None:
    """The model section as its architecture's class (ModelConfig(arch='mistral') becomes a
    MistralConfig), and execution values an old-style model section carried moved into the
    execution section (a conflicting value set there too is refused)."""
    old = old_execution_values(cfg.model)
    if old:
        default = ExecutionConfig()
        clash = [f"model.{k}={v!r} vs execution.{k}={getattr(cfg.execution, k)!r}"
                 for k, v in old.items() if getattr(cfg.execution, k) != getattr(default, k)
                 and getattr(cfg.execution, k) != v]
        if clash:
            fail("execution", f"set twice, differently: {'; '.join(clash)}; keep the "
                 "execution section's")
        object.__setattr__(cfg, "execution", dataclasses.replace(cfg.execution, **old))
    if old or type(cfg.model) is not arch_config_class(cfg.model.arch):
        object.__setattr__(cfg, "model", as_arch_class(cfg.model))


def check_parallel_layout(cfg: Config, degrees: dict[str, int]) -> None:
    """Model and batch sizes against mesh degrees (-1: not known yet, skipped). Runs here with
    the configured degrees and again in parallel/mesh.py once -1 is resolved."""
    m, tensor, pp = cfg.model, degrees["tensor"], degrees["pipeline"]
    if pp == -1 and cfg.pipeline.schedule == "circular":
        fail("mesh.pipeline", "-1 with pipeline.schedule=circular: circular runs store the "
             "layer stack stage-major for their stage count, so set mesh.pipeline explicitly")
    if tensor > 0:
        for name in ("n_heads", "n_kv_heads"):
            if getattr(m, name) % tensor:
                fail(f"model.{name}", f"{getattr(m, name)} is not divisible by mesh.tensor="
                     f"{tensor} (tensor parallelism splits heads); choose mesh.tensor dividing "
                     f"{getattr(m, name)}")
        if m.vocab_size % tensor:
            fail("model.vocab_size", f"{m.vocab_size} is not divisible by mesh.tensor={tensor} "
                 "(tensor parallelism splits the embedding and the output layer along the "
                 "vocabulary); choose mesh.tensor dividing it")
        if cfg.train.seq_len % tensor:
            fail("train.seq_len", f"{cfg.train.seq_len} is not divisible by mesh.tensor="
                 f"{tensor} (sequence parallelism splits the norm regions along the sequence)")
    _check_context(cfg, degrees.get("context", 1), max(tensor, 1), pp)
    if cfg.execution.tp_overlap:
        why = tp_overlap_unsupported(cfg, degrees)
        if why:
            fail("execution.tp_overlap", why)
    if pp > 1 and cfg.train.offload_params:
        fail("train.offload_params", f"does not work with mesh.pipeline={pp}: the pipeline "
             "schedules pick each stage's layer chunk with a traced index, which XLA cannot "
             "do on weights in host memory; use mesh.pipeline=1 (fsdp/data/tensor) or "
             "train.offload_optimizer alone")
    if pp > 1:
        v = cfg.pipeline.resolved_virtual_stages
        if m.n_layers % (pp * v):
            fail("model.n_layers", f"{m.n_layers} layers do not split into mesh.pipeline={pp} "
                 f"stages x pipeline.virtual_stages={v} equal chunks; make n_layers a multiple "
                 f"of {pp * v}")
        micro = cfg.pipeline.microbatches
        rows = cfg.train.batch_size // cfg.train.known_grad_accum
        if rows % micro:
            fail("pipeline.microbatches", f"{micro} does not divide the {rows} sequences of a "
                 "step (train.batch_size / train.grad_accum)")
        if cfg.pipeline.schedule == "circular" and micro < pp:
            fail("pipeline.microbatches", f"the circular schedule needs at least as many "
                 f"microbatches as stages (mesh.pipeline={pp}), got {micro}")
        cfg.lora.check_pipeline_schedule(cfg.pipeline.schedule)
        if cfg.pipeline.schedule == "1f1b" and cfg.execution.matmul_precision == "fp8_delayed":
            fail("pipeline.schedule", "1f1b computes gradients inside its schedule, where "
                 "fp8_delayed's amax histories (carried as gradients) cannot pass; use "
                 "execution.matmul_precision=fp8_tensorwise or pipeline.schedule=gpipe")
    expert = degrees.get("expert", 1)
    if expert != 1:
        cfg.model.check_expert_degree(expert)
    if all(degrees.get(a, 1) > 0 for a in BATCH_AXES):  # -1: resolved later (parallel/mesh)
        ways = batch_ways(degrees)
        micro = cfg.pipeline.microbatches if pp > 1 else 1
        rows = cfg.train.batch_size // (cfg.train.known_grad_accum * micro)
        if cfg.train.batch_size % ways or rows % ways:
            fail("train.batch_size", f"{cfg.train.batch_size} sequences in microbatches of "
                 f"{rows} (grad_accum={cfg.train.grad_accum}, pipeline microbatches={micro}) "
                 f"do not split over mesh data x fsdp{' x expert' if expert > 1 else ''} = "
                 f"{ways}; make each microbatch a multiple of {ways}")


def grad_accum_in_place_unsupported(cfg: Config) -> str | None:
    """Why a step of cfg sums its microbatches' gradients the plain way, or None: in place
    (models/accumulate.py, whose `unsupported` this is; the memory model reads it too)."""
    t = cfg.train
    if t.grad_accum == 1:
        return "train.grad_accum=1: nothing to accumulate"
    if not t.grad_accum_in_place:
        return "train.grad_accum_in_place=False"
    if cfg.execution.remat not in ("full", "full_offload"):
        return (f"execution.remat={cfg.execution.remat!r}: the in-place backward recomputes each layer "
                "from its input, which is execution.remat='full' (or 'full_offload')")
    if cfg.mesh.pipeline > 1:
        return "pipeline parallelism: the stages run their own backward schedule"
    # the sections whose variables the in-place scan cannot carry (config/lora.py, and the
    # model section's class: config/moe.py)
    return cfg.lora.plain_accumulation_reason() or cfg.model.plain_accumulation_reason()


def tp_overlap_unsupported(cfg: Config, degrees: dict[str, int]) -> str | None:
    """Why execution.tp_overlap cannot run on cfg with these mesh degrees, or None. Shared with
    parallel/collective_matmul.unsupported (this module imports no jax). mesh.tensor=1 (or
    not known yet: checked again once resolved) has no tensor ring, so nothing to refuse."""
    if degrees["tensor"] in (1, -1):
        return None
    if degrees["pipeline"] != 1 and cfg.pipeline.schedule == "1f1b":
        return ("pipeline.schedule=1f1b runs each stage's layers under lax.cond, so a ring's "
                "collective-permutes would run on some stages only (XLA:CPU's permute waits for "
                "every device and mixes up ticks; on GPU the communicator set-up is collective "
                "too); use pipeline.schedule=gpipe or circular, or set execution.tp_overlap=false")
    if cfg.execution.matmul_precision in FP8_RECIPES:
        return (f"execution.matmul_precision={cfg.execution.matmul_precision} runs the projections as "
                "FP8 GEMMs (pallas_kernels/fp8), which the collective matmul does not cut into "
                "ring steps: the tensor-parallel collectives would stay whole and exposed; "
                "use execution.matmul_precision=default (or highest), or set "
                "execution.tp_overlap=false")
    return None


def _check_context(cfg: Config, cp: int, tensor: int, pp: int) -> None:
    if cp in (-1, 1):
        return
    seq = cfg.train.seq_len
    if seq % (2 * cp) or seq % (cp * tensor):
        need = math.lcm(2 * cp, cp * tensor)
        fail("train.seq_len", f"{seq} does not split over mesh.context={cp}: each device "
             f"holds two chunks of seq_len / (2 x context) tokens (one from the start, one "
             f"from the end, for causal load balance), split again over mesh.tensor="
             f"{tensor}; make train.seq_len a multiple of {need}")
    if cfg.pipeline.schedule == "1f1b" and pp != 1:
        fail("pipeline.schedule", f"1f1b with mesh.context={cp}: its stages run forward and "
             "backward ticks under stage-dependent branches, and the K/V exchange of "
             "context parallelism cannot sit inside them (the collectives of different "
             "branches would meet); use pipeline.schedule=gpipe or circular")
    impl = cfg.execution.attention_impl
    if impl in ATTENTION_BACKENDS and ATTENTION_BACKENDS[impl].block_fwd is None:
        usable = [n for n, b in ATTENTION_BACKENDS.items() if b.block_fwd is not None]
        fail("execution.attention_impl", f"{impl} cannot run context parallelism (it has no "
             "block form: its attention does not compile inside the shard_map the K/V "
             f"exchange runs in); use auto or one of {usable}")
