"""An imported model computes in the dtype its config.json names (transformers 5 'dtype', 4.x
'torch_dtype'), as transformers runs it; --set and launch.generate --dtype override it."""

from __future__ import annotations

import json

import jax
import pytest

from tests.helpers.hf_runs import HF_CONFIG
from tests.helpers.small import run_small
from titanax.generate import generate, load_for_inference
from titanax.hf.run_config import import_config

pytestmark = pytest.mark.usefixtures("devices8")


@pytest.mark.parametrize("keys, overrides, want", [
    ({"torch_dtype": "float32"}, [], "float32"),
    ({"dtype": "bfloat16", "torch_dtype": "float32"}, [], "bfloat16"),  # 5.x's key first
    ({"dtype": "float16"}, [], "float16"),
    ({"torch_dtype": "float32"}, ["model.dtype=bfloat16"], "bfloat16"),  # --set wins
    ({}, [], "bfloat16"),  # none named: titanax's default
])
def test_import_computes_in_the_published_dtype(tmp_path, keys, overrides, want):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **HF_CONFIG,
                                                      **keys}))
    assert import_config(tmp_path, None, overrides).model.dtype == want


def test_generate_samples_in_the_dtype_asked_for(tmp_path):
    run_small(tmp_path / "run", 1, **{"checkpoint.every_steps": 1})
    got = {}
    for dtype in (None, "bfloat16"):
        cfg, graphdef, params, step = load_for_inference(tmp_path / "run", dtype=dtype,
                                                         devices=jax.devices()[:1])
        got[dtype] = cfg.model.dtype
        assert step == 1 and len(list(generate(cfg, graphdef, params, [5, 6, 7],
                                               max_new_tokens=3))) == 3
    assert got == {None: "float32", "bfloat16": "bfloat16"}  # the run's, then the one asked
