"""The HF tensor table of a decoder built from the common block (HF's Llama/Mistral/Qwen3
names; an architecture adds its own rows, e.g. the q/k norms).

  HF name (layer i)                          HF shape         titanax parameter      per-layer shape
  model.embed_tokens.weight                  [V, D]           embed                  [V, D]
  model.layers.i.input_layernorm.weight      [D]              layers.attn_norm.scale [D]
  model.layers.i.self_attn.q_proj.weight     [H*K, D]         layers.wq              [D, H, K]
  model.layers.i.self_attn.k_proj.weight     [N*K, D]         layers.wk              [D, N, K]
  model.layers.i.self_attn.v_proj.weight     [N*K, D]         layers.wv              [D, N, K]
  model.layers.i.self_attn.o_proj.weight     [D, H*K]         layers.wo              [D, H, K]
  model.layers.i.post_attention_layernorm.weight [D]          layers.mlp_norm.scale  [D]
  model.layers.i.mlp.gate_proj.weight        [F, D]           layers.w_gate          [D, F]
  model.layers.i.mlp.up_proj.weight          [F, D]           layers.w_up            [D, F]
  model.layers.i.mlp.down_proj.weight        [D, F]           layers.w_down          [D, F]
  model.layers.i.self_attn.q_norm.weight     [K]              layers.q_norm.scale    [K] (qk_norm)
  model.layers.i.self_attn.k_norm.weight     [K]              layers.k_norm.scale    [K] (qk_norm)
  model.norm.weight                          [D]              final_norm.scale       [D]
  lm_head.weight (untied only)               [V, D]           output                 [D, V]

A mixture-of-experts layer (models/common/moe_block.py) has, in place of the mlp rows, the
hub's per-expert tensors (expert e; Mixtral's PREFIX is block_sparse_moe and its GATE, UP,
DOWN are w1, w3, w2; Qwen3-MoE's are mlp and gate_proj, up_proj, down_proj):

  model.layers.i.PREFIX.gate.weight              [E, D]       layers.router          [D, E]
  model.layers.i.PREFIX.experts.e.GATE.weight    [F, D]       layers.w_gate          [E, D, F]
  model.layers.i.PREFIX.experts.e.UP.weight      [F, D]       layers.w_up            [E, D, F]
  model.layers.i.PREFIX.experts.e.DOWN.weight    [D, F]       layers.w_down          [E, F, D]

transformers 5 fuses the experts in memory (gate_up_proj [E, 2F, D]) but its save_pretrained
writes them back per expert, as the hub and vLLM have them, so this is the only format.

wo and w_down are stored [out, in] like HF (embed first, so FSDP gathers each layer's slice
along its major axis): o_proj is a reshape and down_proj a plain copy. With
model.tie_embeddings there is no lm_head: HF ties it to embed_tokens as titanax does.

RoPE needs no permutation: titanax rotates pairs (i, i + K/2) ("rotate half"), the layout of
HF checkpoints (Meta's original Llama checkpoints interleave pairs and HF's conversion script
permutes q/k into this layout). The model suite (tests/helpers/model_suite.py) proves it
against transformers' logits for every architecture.
"""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.common.hf_interop import HFTensor, entry


def attention_rows(cfg: ModelConfig) -> list[tuple]:
    """(HF suffix after model.layers.i., titanax path, per-layer shape, transform) of the
    common layer's two norms and attention: everything but the feed-forward."""
    D, K = cfg.d_model, cfg.resolved_head_dim
    H, N = cfg.n_heads, cfg.n_kv_heads
    return [
        ("input_layernorm.weight", ("layers", "attn_norm", "scale"), (D,), "copy"),
        ("self_attn.q_proj.weight", ("layers", "wq"), (D, H, K), "heads_in"),
        ("self_attn.k_proj.weight", ("layers", "wk"), (D, N, K), "heads_in"),
        ("self_attn.v_proj.weight", ("layers", "wv"), (D, N, K), "heads_in"),
        ("self_attn.o_proj.weight", ("layers", "wo"), (D, H, K), "heads_out"),
        ("post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), (D,), "copy"),
    ]


def per_layer_rows(cfg: ModelConfig) -> list[tuple]:
    """The rows of the common decoder layer: attention_rows and the dense SwiGLU."""
    D, F = cfg.d_model, cfg.ffn_dim
    return attention_rows(cfg) + [
        ("mlp.gate_proj.weight", ("layers", "w_gate"), (D, F), "transpose"),
        ("mlp.up_proj.weight", ("layers", "w_up"), (D, F), "transpose"),
        ("mlp.down_proj.weight", ("layers", "w_down"), (D, F), "copy"),
    ]


def moe_rows(cfg: ModelConfig, prefix: str, gate: str, up: str, down: str) -> list[tuple]:
    """The rows of a mixture-of-experts feed-forward (the module docstring's second table).
    An expert's suffix holds '{e}': decoder_table writes one row per layer and expert."""
    D, F, E = cfg.d_model, cfg.ffn_dim, cfg.n_experts
    expert = f"{prefix}.experts.{{e}}"
    return [
        (f"{prefix}.gate.weight", ("layers", "router"), (D, E), "transpose"),
        (f"{expert}.{gate}.weight", ("layers", "w_gate"), (D, F), "transpose"),
        (f"{expert}.{up}.weight", ("layers", "w_up"), (D, F), "transpose"),
        (f"{expert}.{down}.weight", ("layers", "w_down"), (F, D), "transpose"),
    ]


def qk_norm_rows(cfg: ModelConfig) -> list[tuple]:
    """The per-head q/k norm rows (block option qk_norm)."""
    K = cfg.resolved_head_dim
    return [("self_attn.q_norm.weight", ("layers", "q_norm", "scale"), (K,), "copy"),
            ("self_attn.k_norm.weight", ("layers", "k_norm", "scale"), (K,), "copy")]


def decoder_table(cfg: ModelConfig, rows: list[tuple]) -> list[HFTensor]:
    """Embedding, every layer's `rows`, final norm and (untied) lm_head, in the order export
    writes them: all layers of one parameter before the next, so a stacked [L, ...] parameter
    is read from the checkpoint in a few large slices rather than once per layer (a per-expert
    row: every expert of a layer before the next layer)."""
    D, V = cfg.d_model, cfg.vocab_size
    table = [entry("model.embed_tokens.weight", ("embed",), None, (V, D), "copy")]
    for suffix, param, shape, kind in rows:
        if "{e}" not in suffix:
            table += [entry(f"model.layers.{i}.{suffix}", param, i, shape, kind)
                      for i in range(cfg.n_layers)]
            continue
        table += [entry(f"model.layers.{i}.{suffix.format(e=e)}", param, i, shape, kind, e)
                  for i in range(cfg.n_layers) for e in range(cfg.n_experts)]
    table.append(entry("model.norm.weight", ("final_norm", "scale"), None, (D,), "copy"))
    if not cfg.tie_embeddings:
        table.append(entry("lm_head.weight", ("output",), None, (D, V), "transpose"))
    return table
