"""Packed documents in the planner and the step: the attention work the cost model counts for
a document length (from the shard folders' meta.json or --doc-len), and which data sources
send segment ids to attention at all. No compiles: the cost model and the config alone."""

import json

import pytest

from pallas_kernels import aot
from pallas_kernels.flash_attention.tile_ranges import causal_tiles
from titanax.config import load_config
from titanax.plan import Cluster
from titanax.plan.cluster import layout_for
from titanax.plan.cost_model import estimate
from titanax.plan.documents import TILE, attention_share, mean_document_tokens


def _70b(*overrides):
    return load_config(aot.REPO / "configs/llama3_70b.py", ["train.grad_accum=1", *overrides])


def _shards(folder, *counts):
    """A shard folder's meta.json with (n_tokens, n_docs) per shard (no token files needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = [{"file": f"shard_{i:05d}.npy", "n_tokens": t, "n_docs": d}
              for i, (t, d) in enumerate(counts)]
    (folder / "meta.json").write_text(json.dumps({"shards": shards}))
    return str(folder)


def test_synthetic_data_sends_no_segment_ids():
    # Random tokens hold no documents: all-equal ids would only force the masked kernel path.
    assert not _70b().data.masks_documents  # the presets' data.source is synthetic
    assert _70b("data.source=some/folder").data.masks_documents
    assert not _70b("data.source=some/folder", "data.document_masking=false").data.masks_documents


def test_mean_document_tokens_from_meta_json(tmp_path):
    a = _shards(tmp_path / "a", (1000, 1), (3000, 3))   # 1000 tokens per document
    b = _shards(tmp_path / "b", (8000, 2))              # 4000
    assert mean_document_tokens(_70b(f"data.source={a}")) == pytest.approx(1000)
    # A mixture weighs each folder's mean by its share.
    mix = _70b(f"data.source={a}:0.75,{b}:0.25")
    assert mean_document_tokens(mix) == pytest.approx(0.75 * 1000 + 0.25 * 4000)
    assert mean_document_tokens(_70b(f"data.source={tmp_path / 'missing'}")) is None
    assert mean_document_tokens(_70b()) is None  # synthetic: no documents


def test_attention_share_follows_the_kernels_tiles():
    docs = _70b("data.source=f")
    S = docs.train.seq_len
    assert attention_share(docs, None) == 0.5           # unknown length: plain causal
    assert attention_share(docs, 4 * S) == 0.5          # documents longer than the window
    # 2k-token documents in 8k windows: (L/2 + TILE) / S of the full scores, the tile count
    # of tile_ranges.py within 15% (544 of 64 x 64 tiles = 0.133 of the full S^2).
    share = attention_share(docs, 2048)
    assert share == pytest.approx((1024 + TILE) / S)
    assert share == pytest.approx(544 / (S // 128) ** 2, rel=0.15)
    assert share <= 0.5 / 3  # at least 3x below plain causal
    assert causal_tiles(S // 128, 128, 128, S) == 2080
    # cuDNN takes documents as a dense mask: every score.
    assert attention_share(_70b("data.source=f", "execution.attention_impl=cudnn"), 2048) == 1.0
    assert attention_share(_70b(), 2048) == 0.5  # no documents in the step: ignored


def test_documents_shorten_the_predicted_attention_time(tmp_path):
    cluster = Cluster("h100", 8)
    plain = _70b("train.batch_size=128")
    docs = _70b("train.batch_size=128", f"data.source={_shards(tmp_path, (2048 * 50, 50))}")
    layout = layout_for(plain, cluster)
    base = estimate(plain, cluster, layout).breakdown_s["attention"]
    with_docs = estimate(docs, cluster, layout).breakdown_s["attention"]
    assert with_docs == pytest.approx(base * (1024 + TILE) / 8192 / 0.5, rel=1e-6)
    # The flag's length wins over meta.json.
    flagged = estimate(docs, cluster, layout, doc_tokens=4096).breakdown_s["attention"]
    assert flagged == pytest.approx(base * (2048 + TILE) / 8192 / 0.5, rel=1e-6)


def test_plan_cli_doc_len(tmp_path, capsys):
    from launch import plan as launch_plan

    base = ["--config", "configs/llama3_70b.py", "--gpu", "h100", "--nodes", "8", "--no-compile",
            "--set", "train.batch_size=128"]
    launch_plan.main([*base, "--set", f"data.source={tmp_path / 'shards'}", "--doc-len", "2048",
                      "--out", str(tmp_path / "docs")])
    out = capsys.readouterr().out
    assert "documents: 2,048 tokens on average (--doc-len): attention computes 14.1%" in out
    plan = json.loads((tmp_path / "docs" / "plan.json").read_text())
    assert plan["documents"] == {"masked": True, "mean_tokens": 2048.0, "source": "--doc-len",
                                 "attention_share": pytest.approx((1024 + TILE) / 8192)}
    launch_plan.main([*base, "--out", str(tmp_path / "plain")])
    plain = json.loads((tmp_path / "plain" / "plan.json").read_text())
    assert plain["documents"]["masked"] is False and "documents:" not in capsys.readouterr().out
    assert plan["predicted_tokens_per_s_per_gpu"] > plain["predicted_tokens_per_s_per_gpu"]
    # A step without documents cannot take a document length: one line naming the fix.
    with pytest.raises(SystemExit) as e:
        launch_plan.main([*base, "--doc-len", "2048", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2
    assert "--set data.source=FOLDER" in capsys.readouterr().err
