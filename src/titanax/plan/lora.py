"""LoRA in the planner (docs/lora.md): AdapterTraining, what the planner counts for a run whose
optimizer moves the adapters (Role.ADAPTER, train/roles.py) beside a frozen base
(plan/training.py says what each training kind gives), and LoRA's lines in the report.

The adapters are read from the abstract state (plan/state_shape.py), leaf by leaf: a block
weight W [layers, in..., out...] with an adapter gets A [layers, in..., r] and
B [layers, r, out...] (models/common/lora.py). Each factor carries one of W's two feature axes
and 'lora_rank', which maps to no mesh axis (parallel/rules.py), so the two factors shard
differently: the factor on W's 'embed' side (A of the column projections wq, wk, wv, w_gate,
w_up; B of the row projections wo, w_down) over fsdp x context like the weight's embed axis,
the factor on its heads / kv_heads / mlp side over tensor. Neither is split over the other:
with FSDP alone, the heads / mlp side of every adapter is whole on every device.

The state (memory_model): the frozen base in model.param_dtype, with no gradient and no
optimizer state, and the adapters in float32 with their float32 gradients and the update
rule's state (optimizer state is tx.init(adapters)): rows 'base_weights', 'adapters',
'adapter_optimizer', 'adapter_gradients'. The step computes no base weight gradient
(weight_gradients 0: the base's matmuls one forward's worth fewer), the adapters' rank-r
matmuls are HBM traffic (adapter_values_per_token), FSDP reduces only the adapters' gradients.
"""

from __future__ import annotations

import dataclasses

from titanax.config import Config, ModelConfig
from titanax.plan.param_layout import ParamLeaf, ParamSplit, fsdp_group_axes, mesh_axes_of
from titanax.plan.training import weight_bytes
from titanax.train.optim import update_rule

LORA_FLOP_FORMULA = ("LoRA step FLOPs/token = 4*N + 6*N_adapters + 12*L*d*S (no base weight "
                     "gradients; remat not counted)")


def projection_widths(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Block weight -> (its input width, its output width); d_model is the 'embed' side."""
    d, hd = m.d_model, m.resolved_head_dim
    q, kv, f = m.n_heads * hd, m.n_kv_heads * hd, m.ffn_dim
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}


@dataclasses.dataclass(frozen=True)
class AdapterParams:
    """One layer's adapter elements by how they shard, and the layer count."""
    embed_side: int  # per layer: the factors on W's d_model axis (fsdp x context)
    other_side: int  # per layer: the factors on W's heads / kv_heads / mlp axis (tensor)
    n_layers: int

    @classmethod
    def of(cls, leaves: tuple[ParamLeaf, ...], n_layers: int) -> AdapterParams:
        """From the abstract state's adapters ([layers, ...] each): the factors split over the
        FSDP group (their 'embed' axis) and the others."""
        group = fsdp_group_axes()
        on_embed = [any(a in group for n in x.names for a in mesh_axes_of(n)) for x in leaves]
        embed = sum(x.size for x, e in zip(leaves, on_embed, strict=True) if e)
        other = sum(x.size for x, e in zip(leaves, on_embed, strict=True) if not e)
        return cls(embed // n_layers, other // n_layers, n_layers)

    @property
    def per_layer(self) -> int:
        return self.embed_side + self.other_side

    @property
    def total(self) -> int:
        return self.n_layers * self.per_layer

    def per_device(self, deg: dict[str, int]) -> float:
        """Elements on one device: layers over pipeline, each side over its own mesh axes."""
        shards = deg["fsdp"] * deg.get("context", 1)
        return (self.n_layers / deg["pipeline"]
                * (self.embed_side / shards + self.other_side / deg["tensor"]))

    def sides_over_tensor_pipeline(self, deg: dict[str, int]) -> tuple[float, float]:
        """(embed side, other side) elements of one tensor x pipeline coordinate, whole over
        fsdp x context: what the FSDP group reduces."""
        layers = self.n_layers / deg["pipeline"]
        return layers * self.embed_side, layers * self.other_side / deg["tensor"]


@dataclasses.dataclass(frozen=True)
class AdapterTraining:
    """A frozen base and its trained adapters (module docstring)."""
    adapters: AdapterParams
    adapter_bytes: int  # the adapters' dtype width (float32)
    weight_gradients = 0.0  # the base's weight gradients: none computed
    # 1f1b computes every layer weight's gradient inside its own schedule (the config refuses
    # it with LoRA), and so does host offload (it streams the base weights, never updated)
    pipeline_schedules = ("gpipe",)
    host_offload = False
    gradient_row = "adapter_gradients"

    @property
    def adapter_params(self) -> int:
        return self.adapters.total

    def offload_choices(self, options: tuple) -> tuple:
        return options[:1]  # nothing offloaded

    def state_bytes(self, cfg: Config, deg: dict[str, int], p: ParamSplit
                    ) -> tuple[dict[str, float], dict[str, float]]:
        """LoRA's state per device (HBM; the config refuses host offload with LoRA): the
        frozen base (p: its split) in its param dtype alone, the adapters with the update
        rule's state and a gradient buffer."""
        adapters, width = self.adapters.per_device(deg), self.adapter_bytes
        # Only the adapters are differentiated, and their gradients are always summed the plain
        # way (config.grad_accum_in_place_unsupported): the sum and one microbatch's.
        sums = 2 if cfg.train.grad_accum != 1 else 1
        return {"base_weights": p.total * weight_bytes(cfg), "adapters": adapters * width,
                "adapter_optimizer": adapters * update_rule(cfg).state_bytes(width),
                "adapter_gradients": adapters * width * sums}, {}

    def optimized_per_device(self, deg: dict[str, int], p: ParamSplit) -> float:
        return self.adapters.per_device(deg)

    def gradient_groups(self, deg: dict[str, int], layout) -> dict[tuple[str, ...], float]:
        return {("data",): self.adapters.per_device(deg)}

    def fsdp_gradient_elems(self, deg: dict[str, int], fsdp_group_params: float) -> float:
        """The base is gathered but has no gradient; the adapters' d_model-side factors are
        reduce-scattered, their other side (whole on each FSDP rank) all-reduced: twice."""
        embed_side, other_side = self.adapters.sides_over_tensor_pipeline(deg)
        return embed_side + 2 * other_side

    def adapter_values_per_token(self, cfg: Config) -> float:
        """Values per token and layer the adapters move in one forward: each reads its
        projection's input (x A: a rank-r product, bound by reading x) and adds its r-wide
        (x A) B into the projection's output (read and written)."""
        widths = projection_widths(cfg.model)
        return sum(widths[w][0] + 2 * widths[w][1] for w in cfg.lora.weights)

    def step_flops_per_token(self, cfg: Config, n_no_embed: int) -> float:
        """What a LoRA step computes per token without remat (the audit's and the plan's
        'the step's own FLOPs'): the base's forward and activation gradients (4 N), every
        adapter trained (6 x its parameters), attention as the model formula counts it
        (12 L d S)."""
        m = cfg.model
        width = m.n_heads * m.resolved_head_dim
        return (4.0 * n_no_embed + 6.0 * self.adapters.total
                + 12.0 * m.n_layers * width * cfg.train.seq_len)

    def plan_json(self, cfg: Config, est) -> dict:
        """plan.json's "lora": what is trained, what is frozen, and the step's own FLOPs
        beside the model formula's (flops_per_token and predicted_mfu stay the 6 N one
        launch.train logs)."""
        lora = cfg.lora
        return {"lora": {"rank": lora.rank, "alpha": lora.alpha, "weights": list(lora.weights),
                         "adapter_params": est.adapter_params,
                         "adapter_share": est.adapter_params / est.params,
                         "base_param_dtype": cfg.model.param_dtype,
                         "flop_formula": LORA_FLOP_FORMULA,
                         "flops_per_token": est.lora_flops_per_token, "mfu": est.lora_mfu}}


def _lines(plan: dict, line) -> list[str]:
    """[line(the plan's LoRA entry)], or none for a plan without LoRA."""
    lo = plan.get("lora")
    return [line(lo)] if lo else []


def lora_lines(plan: dict) -> list[str]:
    """The report's line on what a LoRA plan trains and holds frozen (none without LoRA)."""
    return _lines(plan, lambda lo: (
        f"LoRA: rank {lo['rank']} (alpha {lo['alpha']:g}) on {', '.join(lo['weights'])}: "
        f"{lo['adapter_params']:,} adapter parameters ({lo['adapter_share']:.2%}) trained in "
        f"float32; the base frozen in {lo['base_param_dtype']}, without gradients or "
        "optimizer state"))


def lora_step_lines(plan: dict) -> list[str]:
    """The report's line on a LoRA step's own FLOPs and MFU (none without LoRA)."""
    return _lines(plan, lambda lo: (
        f"  => LoRA step: {lo['flops_per_token']:.3e} FLOPs per token "
        f"({lo['flop_formula']}): {lo['mfu']:.1%} of peak; the MFU above counts the model's "
        "6*N, as launch.train logs it"))


def lora_title(plan: dict) -> str:
    """The memory chart's title prefix (plan/render.py): what LoRA freezes ('' without)."""
    lo = plan.get("lora")
    return f"LoRA rank {lo['rank']}, base frozen in {lo['base_param_dtype']}; " if lo else ""
