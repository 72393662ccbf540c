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


def per_layer_rows(cfg: ModelConfig) -> list[tuple]:
    """(HF suffix after model.layers.i., titanax path, per-layer shape, transform) of the
    common decoder layer."""
    D, F, K = cfg.d_model, cfg.ffn_dim, cfg.resolved_head_dim
    H, N = cfg.n_heads, cfg.n_kv_heads
    return [
        ("input_layernorm.weight", ("layers", "attn_norm", "scale"), (D,), "copy"),
        ("self_attn.q_proj.weight", ("layers", "wq"), (D, H, K), "heads_in"),
        ("self_attn.k_proj.weight", ("layers", "wk"), (D, N, K), "heads_in"),
        ("self_attn.v_proj.weight", ("layers", "wv"), (D, N, K), "heads_in"),
        ("self_attn.o_proj.weight", ("layers", "wo"), (D, H, K), "heads_out"),
        ("post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), (D,), "copy"),
        ("mlp.gate_proj.weight", ("layers", "w_gate"), (D, F), "transpose"),
        ("mlp.up_proj.weight", ("layers", "w_up"), (D, F), "transpose"),
        ("mlp.down_proj.weight", ("layers", "w_down"), (D, F), "copy"),
    ]


def qk_norm_rows(cfg: ModelConfig) -> list[tuple]:
    """The per-head q/k norm rows (block option qk_norm)."""
    K = cfg.resolved_head_dim
    return [("self_attn.q_norm.weight", ("layers", "q_norm", "scale"), (K,), "copy"),
            ("self_attn.k_norm.weight", ("layers", "k_norm", "scale"), (K,), "copy")]


def decoder_table(cfg: ModelConfig, rows: list[tuple]) -> list[HFTensor]:
    """Embedding, every layer's `rows`, final norm and (untied) lm_head, in the order export
    writes them: all layers of one parameter before the next, so a stacked [L, ...] parameter
    is read from the checkpoint in a few large slices rather than once per layer."""
    D, V = cfg.d_model, cfg.vocab_size
    table = [entry("model.embed_tokens.weight", ("embed",), None, (V, D), "copy")]
    for suffix, param, shape, kind in rows:
        table += [entry(f"model.layers.{i}.{suffix}", param, i, shape, kind)
                  for i in range(cfg.n_layers)]
    table.append(entry("model.norm.weight", ("final_norm", "scale"), None, (D,), "copy"))
    if not cfg.tie_embeddings:
        table.append(entry("lm_head.weight", ("output",), None, (D, V), "transpose"))
    return table
