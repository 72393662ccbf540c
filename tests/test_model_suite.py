"""The model suite (tests/helpers/model_suite.py) on every architecture it lists: HF logits
parity against transformers both ways, greedy continuations equal to transformers', the parameter count, export/import identity, a parallel
layout equal to one device. One transformers subprocess serves every model; then the
architecture-specific facts (published sizes, refused sliding windows)."""

import types

import jax
import numpy as np
import pytest
from torch_peer import run_jobs

from tests.helpers import model_suite as suite
from titanax.config import ConfigError, apply_overrides
from titanax.hf.source import merge_config
from titanax.models import model_spec, preset

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices
NAMES = list(suite.MODELS)


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """Every model's run and export, and transformers' side of all of them in one subprocess."""
    tmp = tmp_path_factory.mktemp("suite")
    tokens = np.random.default_rng(0).integers(0, 384, (2, 48)).astype(np.int32)
    np.save(tmp / "tokens.npy", tokens)
    originals, jobs = {}, []
    for name in NAMES:
        originals[name], more = suite.prepare(name, tmp, tmp / "tokens.npy")
        jobs += more
    run_jobs("model_peer.py", jobs, tmp)
    return types.SimpleNamespace(tmp=tmp, tokens=tokens, originals=originals)


@pytest.mark.parametrize("name", NAMES)
def test_export_gives_transformers_logits(peer, name):
    suite.check_export_parity(name, peer.tmp, peer.tokens)


@pytest.mark.parametrize("name", NAMES)
def test_import_gives_transformers_logits(peer, name, tmp_path):
    suite.check_import_parity(name, peer.tmp, peer.tokens, tmp_path / "imported")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_continuation_is_transformers(peer, name):
    suite.check_greedy(name, peer.tmp)


@pytest.mark.parametrize("name", NAMES)
def test_param_count_is_transformers(peer, name):
    suite.check_param_count(name, peer.tmp)


@pytest.mark.parametrize("name", NAMES)
def test_export_then_import_is_the_identity(peer, name, tmp_path):
    suite.check_round_trip(name, peer.tmp, peer.originals[name], tmp_path / "roundtrip")


@pytest.mark.parametrize("name", NAMES)
def test_layout_matches_one_device(name):
    if (why_not := suite.check_layout(name)) is not None:
        pytest.skip(why_not)


def test_mistral_size_and_refused_sliding_window():
    assert model_spec("mistral").count_params(preset("mistral_7b")) == 7_248_023_552
    cfg = suite.hf_config_of("mistral")
    hf = {**suite.MODELS["mistral"].hf_config, "model_type": "mistral"}
    spec = model_spec(cfg.model)
    assert spec.hf.mismatches(hf, cfg.model) == []
    assert spec.hf.to_config(cfg.model, dtype="float32", bos_id=0, eos_id=1)[
        "sliding_window"] is None
    v0_1 = {**hf, "sliding_window": 4096, "max_position_embeddings": 32768}
    for refused in (v0_1, {**hf, "sliding_window": 63}):  # max_position_embeddings 64
        with pytest.raises(ValueError, match="sliding_window=.* is not supported"):
            spec.hf.mismatches(refused, cfg.model)
    # A window that hides nothing (at least max_position_embeddings) is kept as the model's own
    # field and written back on export.
    kept = apply_overrides(cfg, {"model.sliding_window": 64}).model
    assert spec.hf.mismatches({**hf, "sliding_window": 64}, kept) == []
    assert spec.hf.to_config(kept, dtype="float32", bos_id=0, eos_id=1)["sliding_window"] == 64
    with pytest.raises(ConfigError, match=r"model.sliding_window: 63 \(below model.max_seq_len"):
        apply_overrides(cfg, {"model.sliding_window": 63})


def test_moe_configs_both_ways_and_refused_ones():
    """Mixtral's and Qwen3-MoE's config.json: what export writes reads back to the same config
    (Qwen3-MoE's num_experts as published, or transformers 5's num_local_experts); dense
    layers, sliding windows, router jitter and a Mixtral without renormalisation are refused
    in one line."""
    for name in ("mixtral", "qwen3_moe"):
        cfg = suite.hf_config_of(name).model
        spec = model_spec(cfg)
        written = spec.hf.to_config(cfg, dtype="float32", bos_id=0, eos_id=1)
        assert written["model_type"] == name and written["output_router_logits"] is False
        assert spec.hf.mismatches(written, cfg) == []
        fewer = apply_overrides(suite.hf_config_of(name), {"model.n_experts": 3}).model
        n = cfg.n_experts
        assert spec.hf.mismatches(written, fewer) == [
            f"model.n_experts=3 but config.json says {n} (--set model.n_experts={n})"]
    qwen = suite.hf_config_of("qwen3_moe").model
    hf = model_spec(qwen).hf
    written = hf.to_config(qwen, dtype="float32", bos_id=0, eos_id=1)
    assert written["moe_intermediate_size"] == 48 and written["num_experts"] == 8
    v5 = {k: v for k, v in written.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert hf.mismatches(v5, qwen) == []
    # An imported source's dense intermediate_size (unused: every layer is sparse) goes back
    # out as it came in; ours is the expert width, which a dense model's must stay.
    source = {**written, "intermediate_size": 6144, "moe_intermediate_size": 768}
    merged = merge_config(written, source, qwen.max_seq_len, hf.source_keeps)
    assert (merged["intermediate_size"], merged["moe_intermediate_size"]) == (6144, 48)
    llama = suite.hf_config_of("llama3").model
    ours = model_spec(llama).hf.to_config(llama, dtype="float32", bos_id=0, eos_id=1)
    merged = merge_config(ours, {**ours, "intermediate_size": 6144}, llama.max_seq_len,
                          model_spec(llama).hf.source_keeps)
    assert merged["intermediate_size"] == llama.ffn_dim
    for refused, match in (({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
                           ({"mlp_only_layers": [0]}, "mlp_only_layers=.0."),
                           ({"use_sliding_window": True}, "sliding-window")):
        with pytest.raises(ValueError, match=match):
            hf.mismatches({**written, **refused}, qwen)
    mixtral = suite.hf_config_of("mixtral").model
    hf = model_spec(mixtral).hf
    written = hf.to_config(mixtral, dtype="float32", bos_id=0, eos_id=1)
    for refused, match in (({"sliding_window": 32}, "sliding_window=32"),
                           ({"router_jitter_noise": 0.01}, "router_jitter_noise")):
        with pytest.raises(ValueError, match=match):
            hf.mismatches({**written, **refused}, mixtral)
    unnormalised = apply_overrides(suite.hf_config_of("mixtral"), {"model.norm_topk_prob": False})
    with pytest.raises(ValueError, match="model.norm_topk_prob=False: Mixtral"):
        hf.to_config(unnormalised.model, dtype="float32", bos_id=0, eos_id=1)


def test_moe_routing_bias_starts_at_zero_on_import_and_export_must_drop_it(peer, tmp_path):
    """DeepSeek-V3's routing bias (model.router_bias_update_rate > 0) has no tensor in
    Mixtral's HF format: an import starts it at 0 (the plain router, as a new run's), and an
    export of such a run is refused in one line naming --drop-router-bias, which exports the
    HF tensors alone."""
    from titanax.checkpoint.reader import CheckpointReader
    from titanax.hf.exporter import export_hf
    from titanax.hf.folder import locate
    from titanax.hf.importer import import_hf

    cfg = apply_overrides(suite.hf_config_of("mixtral"), {"model.router_bias_update_rate": 1e-3})
    source = peer.tmp / "mixtral" / "export"
    import_hf(source, cfg, tmp_path / "run", devices=jax.devices()[:1], progress=False,
              log=lambda *_: None)
    reader = CheckpointReader(tmp_path / "run" / "checkpoints")
    bias = reader.read(("layers", "router_bias"))
    assert bias.shape == (cfg.model.n_layers, cfg.model.n_experts) and not bias.any()
    with pytest.raises(ValueError, match=r"\['layers.router_bias'\] .*--drop-router-bias"):
        export_hf(tmp_path / "run", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    export_hf(tmp_path / "run", tmp_path / "out", dtype="float32", progress=False,
              drop_unmapped=True)
    assert set(locate(tmp_path / "out")) == set(locate(source))
