"""The ModelSpec hooks of a mixture-of-experts decoder (MoEBlock, common/moe_block.py): its
loss terms and logged routing statistics, read from the layer sums the decoder kept after the
forward pass (Decoder.layer_aux), and its FLOPs per token counted on the active parameters."""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.common.moe import load_balancing_loss
from titanax.models.spec import PROBE, flops_per_token


def moe_aux_losses(model) -> dict:
    """{'load_balance': router_aux_loss_coef x the Switch/Mixtral loss pooled over the
    layers[, 'router_z': router_z_loss_coef x the z-loss, a mean over tokens and layers]
    [, PROBE: 0.0 carrying the layers' loads to their routing biases (common/moe_bias.py)]}."""
    cfg, sums = model.cfg, model.layer_aux.get_value()
    terms = {"load_balance": cfg.router_aux_loss_coef * load_balancing_loss(sums)}
    if cfg.router_z_loss_coef:
        terms["router_z"] = cfg.router_z_loss_coef * sums["z_sum"] / sums["rows"]
    if PROBE in sums:
        terms[PROBE] = sums[PROBE]
    return terms


def moe_aux_metrics(model) -> dict:
    """The unweighted load-balancing loss (A when balanced), the busiest expert's load over
    the mean, averaged over the layers and a pipeline's microbatches by tokens (1.0: perfect
    balance), and the share of (token, expert) pairs expert parallelism's capacity dropped
    (0 when dropless)."""
    sums, cfg = model.layer_aux.get_value(), model.cfg
    return {"load_balance_loss": load_balancing_loss(sums),
            "max_over_mean_load": sums["max_over_mean_load"] / sums["rows"],
            "dropped_fraction": sums["dropped"] / (sums["rows"] * cfg.experts_per_token)}


def inactive_expert_params(cfg: ModelConfig) -> int:
    """The expert parameters a token does not run: (n_experts - experts_per_token) SwiGLUs of
    3 x d_model x ffn_dim per layer."""
    per_expert = 3 * cfg.d_model * cfg.ffn_dim
    return cfg.n_layers * (cfg.n_experts - cfg.experts_per_token) * per_expert


def moe_flops_per_token(cfg: ModelConfig, seq_len: int, n_params_no_embed: int) -> float:
    """The dense formula (6 N + 12 L d S) on the active parameters: what a token computes."""
    return flops_per_token(cfg, seq_len, n_params_no_embed - inactive_expert_params(cfg))
