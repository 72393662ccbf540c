"""The fields every mixture-of-experts decoder adds to the model section (MoEModelConfig, the
base of models/mixtral/config.py and models/qwen3_moe/config.py): how many experts, how many
each token uses, the router's losses and its balancing bias. Every layer's feed-forward is the
MoE one (no dense layers between), each expert a SwiGLU of model.ffn_dim (Mixtral's
intermediate_size, Qwen3-MoE's moe_intermediate_size)."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.errors import fail
from titanax.config.model import ModelConfig


@dataclass(frozen=True)
class MoEModelConfig(ModelConfig):
    n_experts: int = 8  # experts per layer, each a SwiGLU of model.ffn_dim
    experts_per_token: int = 2  # the router's top-k: experts each token's output mixes
    # The top-k weights renormalised to sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob),
    # else the router softmax's probabilities as they are.
    norm_topk_prob: bool = True
    # Weight of the Switch/Mixtral load-balancing loss in the step's loss (transformers'
    # router_aux_loss_coef; pooled over the layers as transformers pools it).
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0  # weight of ST-MoE's router z-loss (0: off)
    # DeepSeek-V3's auxiliary-loss-free balancing (its bias update speed; TorchTitan's
    # load_balance_coeff; 0.001 in DeepSeek-V3): > 0 gives every layer a routing bias [E]
    # (params layers.router_bias, float32, starting at 0) added to the router's probabilities
    # for the choice of experts only (the gates stay unbiased), and after each step moves it
    # by this much per expert towards balance: up for the experts below the layer's mean load,
    # down for those above (centred). The optimizer does not train it (common/moe_bias.py).
    # 0: off, no such parameter. Usually with router_aux_loss_coef small or 0.
    router_bias_update_rate: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.n_experts < 1:
            fail("model.n_experts", f"must be >= 1, got {self.n_experts}")
        if not 1 <= self.experts_per_token <= self.n_experts:
            fail("model.experts_per_token", f"{self.experts_per_token} must lie in [1, "
                 f"model.n_experts={self.n_experts}]")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
            if getattr(self, name) < 0:
                fail(f"model.{name}", f"must be >= 0, got {getattr(self, name)}")

    def check_run(self, cfg) -> None:
        """What a mixture-of-experts model cannot run with yet, one line each."""
        arch = f"model.arch={self.arch!r} (mixture of experts)"
        if cfg.mesh.pipeline != 1 and cfg.pipeline.schedule == "1f1b":
            fail("pipeline.schedule", f"'1f1b' with {arch} is not implemented yet (its "
                 "backward runs inside the tick loop, where the routing sums' loss is not "
                 "formed yet); use pipeline.schedule=gpipe or circular")
        if cfg.execution.matmul_precision not in ("default", "highest"):
            fail("execution.matmul_precision", f"{cfg.execution.matmul_precision!r}: the "
                 f"experts' grouped GEMMs of {arch} have no FP8 recipe yet; use default or "
                 "highest")
        if cfg.lora.enabled:  # the MoE side of a pairing neither section supports yet
            fail("lora.rank", f"{cfg.lora.rank}: LoRA adapters on {arch} are not "
                 "implemented yet; set lora.rank=0")
        if cfg.execution.tp_overlap:
            fail("execution.tp_overlap", self.tp_overlap_refusal())

    def splits_experts(self, expert: int) -> bool:
        return self.n_experts % expert == 0

    def tp_overlap_refusal(self) -> str | None:
        return (f"the experts of model.arch={self.arch!r} (mixture of experts) have no "
                "collective matmul; set execution.tp_overlap=false")

    def check_expert_degree(self, expert: int) -> None:
        """Each expert rank holds n_experts / mesh.expert experts (-1: not resolved yet)."""
        if expert > 0 and self.n_experts % expert:
            fail("mesh.expert", f"{expert} does not divide model.n_experts={self.n_experts}; "
                 "choose a divisor (each expert rank holds n_experts / mesh.expert experts)")

    def plain_accumulation_reason(self) -> str | None:
        # The in-place scan carries no routing sums (models/accumulate.py); the plain sum does.
        return "a mixture-of-experts model: its layers return routing sums, summed the plain way"
