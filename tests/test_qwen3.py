"""Qwen3 dense (models/qwen3): what the model suite (tests/test_model_suite.py: HF parity
against transformers' Qwen3ForCausalLM, parameter count, parallel layouts, round trip) does
not cover: the published sizes and the refused sliding-window configs."""

import pytest

from tests.helpers.hf_runs import hf_small_config
from titanax.models import model_spec, preset


def test_presets_have_the_published_sizes():
    count = lambda name: model_spec("qwen3").count_params(preset(name))  # noqa: E731
    assert preset("qwen3_0_6b").arch == "qwen3" and preset("qwen3_0_6b").tie_embeddings
    assert count("qwen3_0_6b") == 596_049_920  # 0.6B, 0.44B without the (tied) embedding
    assert count("qwen3_8b") == 8_190_735_360


def test_sliding_window_configs_are_refused():
    cfg = hf_small_config(**{"model.arch": "qwen3", "model.head_dim": 32,
                             "model.rope_scaling": "none"})
    hf = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 160,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "model_type": "qwen3", "use_sliding_window": True}
    with pytest.raises(ValueError, match="sliding-window"):
        model_spec(cfg.model).hf.mismatches(hf, cfg.model)
