"""The model section: what the weights are. Its class is the architecture's own (each
titanax/models/<arch>/config.py subclasses ModelConfig with the fields that architecture adds),
chosen by model.arch; a checkpoint is resumed only by the same model section, compared whole.
How the weights are computed is the execution section (config/execution.py)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import warnings
from dataclasses import dataclass
from typing import ClassVar

from titanax.archs import ARCHS
from titanax.config.errors import ConfigError, check_choice, check_positive, check_types, fail
from titanax.config.execution import DTYPES, ExecutionConfig

ROPE_SCALINGS = ("none", "llama3")
EXECUTION_FIELDS = tuple(f.name for f in dataclasses.fields(ExecutionConfig))


class _TakesOldExecutionFields(type):
    """Configs written before the execution section passed its fields to ModelConfig(...) or
    preset(...) (e.g. preset('tiny', dtype='float32')). They still load: the values ride on the
    instance until Config moves them into its execution section (Config.__post_init__), with a
    FutureWarning naming the new spelling."""

    def __call__(cls, *args, **kwargs):
        old = {k: kwargs.pop(k) for k in EXECUTION_FIELDS if k in kwargs}
        obj = super().__call__(*args, **kwargs)
        if old:
            warnings.warn(f"{cls.__name__}({', '.join(f'{k}=' for k in old)}...): these are "
                          "execution fields now; write Config(execution=ExecutionConfig("
                          f"{', '.join(f'{k}=...' for k in old)})) (titanax.config). Taken "
                          "as given for this run.", FutureWarning, stacklevel=2)
            object.__setattr__(obj, "_old_execution", old)
        return obj


def old_execution_values(model: ModelConfig) -> dict:
    """The execution values an old-style config passed to the model section (see above)."""
    return dict(getattr(model, "_old_execution", {}))


@dataclass(frozen=True)
class ModelConfig(metaclass=_TakesOldExecutionFields):
    """What every dense decoder titanax builds has (an architecture's class adds its own
    fields). A preset (titanax.models.preset) sets them all, arch included."""

    arch: str = "llama3"  # a key of titanax/archs.py ARCHS
    vocab_size: int = 4096  # embedding and output rows; at least the tokenizer's size
    d_model: int = 256  # residual stream width
    n_layers: int = 4  # decoder layers
    n_heads: int = 8  # query heads
    n_kv_heads: int = 4  # key/value heads (grouped-query attention; divides n_heads)
    head_dim: int = 0  # 0: d_model // n_heads
    ffn_dim: int = 768  # SwiGLU hidden width
    rope_theta: float = 500000.0  # RoPE base frequency
    # Llama 3.1 frequency scaling: long wavelengths divided by rope_factor, short ones kept,
    # a smooth blend between (models/common/layers.py rope_inv_freq).
    rope_scaling: str = "llama3"
    rope_factor: float = 8.0  # llama3 scaling: long wavelengths divided by this
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths beyond original/this are scaled
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original/this are kept
    rope_original_max_seq_len: int = 8192  # llama3 scaling: the pretraining context length
    max_seq_len: int = 2048  # the longest sequence trained or sampled (train.seq_len <= it)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    # The output layer is the input embedding transposed (Llama 3.2 1B/3B): no
    # separate 'output' parameter; HF export writes tie_word_embeddings and no lm_head.
    tie_embeddings: bool = False
    param_dtype: str = "float32"  # master weights (the compute dtype is execution.dtype)
    # The rope_scaling values the architecture's Hugging Face form can express: an
    # architecture with plain RoPE only (Mistral, Mixtral, Qwen3, Qwen3-MoE) sets ("none",)
    # and defaults rope_scaling to "none"; llama3 scaling there is warned of at config time
    # (export refuses it), so a run saved with it still resumes.
    ROPE_SCALINGS: ClassVar[tuple[str, ...]] = ROPE_SCALINGS

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def __post_init__(self):
        check_types("model", self)
        if not self.arch:
            fail("model.arch", f"must name an architecture, one of {sorted(ARCHS)}")
        check_positive("model", self, "vocab_size", "d_model", "n_layers", "n_heads",
                       "n_kv_heads", "ffn_dim", "rope_theta", "max_seq_len", "norm_eps")
        if self.head_dim < 0:
            fail("model.head_dim", "must be >= 0 (0 means d_model // n_heads)")
        if self.head_dim == 0 and self.d_model % self.n_heads:
            fail("model.d_model", f"{self.d_model} is not divisible by model.n_heads="
                 f"{self.n_heads}; change one of them or set model.head_dim explicitly")
        if self.resolved_head_dim % 2:
            fail("model.head_dim", f"rotary embeddings need an even head dim, got "
                 f"{self.resolved_head_dim}")
        if self.n_heads % self.n_kv_heads:
            fail("model.n_kv_heads", f"model.n_heads={self.n_heads} must be a multiple of "
                 f"model.n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        check_choice("model.param_dtype", self.param_dtype, DTYPES)
        check_choice("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling not in self.ROPE_SCALINGS:
            # A warning, not a refusal: a run saved before this architecture's default became
            # "none" was trained with llama3 scaling and must still resume with it.
            warnings.warn(f"model.rope_scaling={self.rope_scaling!r}: model.arch={self.arch} "
                          f"has plain RoPE only (its Hugging Face config.json cannot express "
                          f"{self.rope_scaling} scaling, so launch.export_hf will refuse this "
                          f"run); for a new run set model.rope_scaling={self.ROPE_SCALINGS[0]}",
                          stacklevel=2)
        if self.rope_scaling == "llama3":
            check_positive("model", self, "rope_factor", "rope_low_freq_factor",
                           "rope_high_freq_factor", "rope_original_max_seq_len")
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                fail("model.rope_high_freq_factor", "must be larger than "
                     "model.rope_low_freq_factor")

    # --- What the run-wide checks (config/rules.py) ask of an architecture, a dense decoder's
    # answers here; a subclass (config/moe.py MoEModelConfig) overrides those it differs in,
    # so the checks name no architecture class.
    def check_run(self, cfg) -> None:
        """Refuse (config.errors.fail) the whole-run settings cfg (a Config) this architecture
        cannot train with yet: a dense decoder takes them all."""

    def check_expert_degree(self, expert: int) -> None:
        """Refuse mesh.expert = expert (> 1, or -1: not resolved yet): expert parallelism
        splits experts, and a dense decoder has none."""
        fail("mesh.expert", f"{expert}: expert parallelism splits a mixture-of-experts "
             f"model's experts, and model.arch={self.arch!r} has none; set mesh.expert=1 "
             "(use mesh.data or mesh.fsdp for more data parallelism)")

    def splits_experts(self, expert: int) -> bool:
        """Whether mesh.expert = expert splits this model's experts: a dense decoder has
        none to split, so only 1 (plan/search.py tries the degrees this takes)."""
        return expert == 1

    def tp_overlap_refusal(self) -> str | None:
        """Why execution.tp_overlap cannot run on this architecture whatever the layout, or
        None: a dense decoder's projections all have a collective matmul."""
        return None

    def plain_accumulation_reason(self) -> str | None:
        """Why this architecture's microbatch gradients are summed the plain way rather than
        in place (config.grad_accum_in_place_unsupported), or None: a dense decoder's layers
        return nothing but their output, so the in-place scan takes them."""
        return None



@dataclass(frozen=True)
class PlainRopeModelConfig(ModelConfig):
    """The base of an architecture whose Hugging Face form has plain RoPE only (Mistral,
    Mixtral, Qwen3, Qwen3-MoE): rope_scaling defaults to "none" and nothing else is exported.
    An MoE architecture names it before MoEModelConfig, whose inherited default would win."""
    rope_scaling: str = "none"  # plain RoPE: its Hugging Face form has no llama3 scaling
    ROPE_SCALINGS = ("none",)

def arch_config_class(arch: str) -> type[ModelConfig]:
    """The model section's class for model.arch (CONFIG in titanax/models/<arch>/config.py,
    which imports no jax); a ConfigError naming the field for an unknown arch."""
    if arch not in ARCHS:
        close = difflib.get_close_matches(arch, ARCHS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"model.arch: {arch!r} is not one of {sorted(ARCHS)} (registered in "
                          f"titanax/archs.py).{hint}")
    return importlib.import_module(f"{ARCHS[arch]}.config").CONFIG


def model_field_names(arch: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(arch_config_class(arch)))


def as_arch_class(model: ModelConfig, arch: str | None = None, **changes) -> ModelConfig:
    """model (with changes) as an instance of its architecture's class: a field the target
    class lacks is dropped when it holds its default and refused otherwise (it would be lost)."""
    arch = changes.get("arch", arch or model.arch)
    cls = arch_config_class(arch)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    switching = type(model) is not cls
    for f in dataclasses.fields(model):
        explicit = f.name in changes
        value = changes.pop(f.name, getattr(model, f.name))
        if (switching and not explicit and f.name == "rope_scaling"
                and value not in cls.ROPE_SCALINGS):
            # Another architecture's scaling (the llama3 preset's, ModelConfig's default),
            # which this one's Hugging Face form cannot express: this one's default instead.
            value = cls.__dataclass_fields__["rope_scaling"].default
        if f.name in known:
            values[f.name] = value
        elif value != f.default:
            raise ConfigError(f"model.{f.name}: {arch} has no such field ({cls.__name__}, "
                              f"{ARCHS[arch].replace('.', '/')}/config.py); unset it or "
                              f"choose another model.arch")
    for name in changes:  # a field the model section's class lacks
        if name in known:
            values[name] = changes[name]
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" Did you mean 'model.{close[0]}'?" if close else ""
        raise ConfigError(f"model.{name}: {arch} has no such field ({cls.__name__}).{hint}")
    values["arch"] = arch
    return cls(**values)
