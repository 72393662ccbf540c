"""Hub ids for launch.import_hf (`--hf org/name[@revision]`, through huggingface_hub's cache) and
launch.export_hf --push-to-hub, with no network: a hub cache laid out as huggingface_hub lays it
out holds a small export, a local HTTP server answers as the hub does for a missing repo or
revision, and the upload calls are stubbed."""

from __future__ import annotations

import json
import pathlib
import shutil
import socket
import subprocess
import sys
import types

import numpy as np
import pytest

from tests.helpers.cli import ROOT, assert_one_error, cli
from tests.helpers.hf_runs import hf_small_config, make_run
from tests.helpers.hub_cache import FakeHub, fill_hub_cache
from titanax.hf.source import base_origin

REPO = "titanax-test/tiny-llama"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A run, its export (sharded: the index names the shards), a hub cache holding the export
    as REPO, and the export imported from its folder by launch.import_hf."""
    from launch.import_hf import main
    from titanax.hf.exporter import export_hf

    tmp = tmp_path_factory.mktemp("hub")
    make_run(tmp / "run", hf_small_config())
    export_hf(tmp / "run", tmp / "export", dtype="float32", max_shard_bytes=200_000,
              progress=False)
    commit = fill_hub_cache(tmp / "cache", REPO, tmp / "export")
    main(["--hf", str(tmp / "export"), "--workdir", str(tmp / "direct")])
    return types.SimpleNamespace(tmp=tmp, cache=tmp / "cache", commit=commit,
                                 export=tmp / "export", direct=tmp / "direct")


def _contents(workdir: pathlib.Path) -> dict:
    """What an import wrote, the workdir's own path taken out of the config (and the origin
    it records apart: a hub id or the folder)."""
    from titanax.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(workdir / "checkpoints")
    return {"config": json.loads((workdir / "config.json").read_text().replace(str(workdir), "W")),
            "files": {str(p.relative_to(workdir)): p.read_bytes()
                      for sub in ("hf_source", "hf_tokenizer") for p in (workdir / sub).iterdir()
                      if p.name != "origin.json"},
            "params": {path: reader.read(path) for path in reader.params()}}


def _assert_same_run(a: pathlib.Path, b: pathlib.Path) -> None:
    ca, cb = _contents(a), _contents(b)
    assert ca["config"] == cb["config"] and ca["files"] == cb["files"]
    assert ca["params"].keys() == cb["params"].keys()
    for path, value in ca["params"].items():
        np.testing.assert_array_equal(value, cb["params"][path], err_msg=".".join(path))


def test_hub_id_imports_from_the_offline_cache(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec in (REPO, f"{REPO}@{hub.commit}"):
        work = tmp_path / spec.replace("/", "_").replace("@", "_")
        r = cli("launch.import_hf", "--hf", spec, "--workdir", work)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"at commit {hub.commit}" in r.stdout
        _assert_same_run(hub.direct, work)
        # the base a LoRA run's PEFT export names (hf/source.py)
        assert base_origin(work) == (REPO, hub.commit)
    assert base_origin(hub.direct) == (str(hub.export.absolute()), None)
    assert len(json.loads((hub.export / "model.safetensors.index.json").read_text())
               ["weight_map"].values()) > 1
    # No network (a port nothing listens on), HF_HUB_OFFLINE unset: the cache stands in.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    r = subprocess.run([sys.executable, "-c", "from titanax.hf.hub import resolve_model_folder; "
                        f"resolve_model_folder({REPO!r})"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and f"at commit {hub.commit}" in r.stdout, r.stderr[-3000:]


def test_not_in_the_cache_offline_or_unknown_online_is_one_line(hub, tmp_path, monkeypatch):
    empty = tmp_path / "empty_cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(empty))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = cli("launch.import_hf", "--hf", REPO, "--workdir", tmp_path / "w")
    assert_one_error(r, 2, str(empty), "HF_HUB_OFFLINE", "HF_HOME", "network access")
    # The repository is cached, the revision is not.
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.cache))
    r = cli("launch.import_hf", "--hf", f"{REPO}@v9", "--workdir", tmp_path / "w")
    assert_one_error(r, 2, "not revision 'v9'", "cached refs: main", "HF_HUB_OFFLINE")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_CACHE", str(empty))
    with FakeHub(known=REPO) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        r = cli("launch.import_hf", "--hf", "titanax-test/no-such-model", "--workdir", tmp_path / "w")
        assert_one_error(r, 2, "no model repository titanax-test/no-such-model", fake.url)
        r = cli("launch.import_hf", "--hf", f"{REPO}@no-branch", "--workdir", tmp_path / "w")
        assert_one_error(r, 2, "has no revision 'no-branch'")
    r = cli("launch.import_hf", "--hf", "./missing/model", "--workdir", tmp_path / "w")
    assert_one_error(r, 2, "no such folder", "org/name[@revision]")
    assert not (tmp_path / "w").exists()


def test_a_folder_wins_over_a_hub_id_and_only_import_files_are_fetched(hub, tmp_path,
                                                                     monkeypatch):
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from titanax.hf.hub import hub_id, resolve_model_folder

    assert hub_id("org/name") == ("org/name", None)
    assert hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    assert [hub_id(s) for s in ("/abs/x", "./x", "a/b/c", "~/x", "name", "org/name@")] == [None] * 6

    calls = []
    snap = tmp_path / "snapshots" / hub.commit  # the index, its shards not yet downloaded
    snap.mkdir(parents=True)
    shutil.copy(hub.export / "model.safetensors.index.json", snap)

    def snapshot_download(repo_id, *, revision, allow_patterns):
        calls.append((repo_id, revision, allow_patterns))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "titanax-test").mkdir()
    (tmp_path / REPO).symlink_to(hub.export)
    assert resolve_model_folder(REPO, log=lambda *_: None) == pathlib.Path(REPO) and not calls

    resolve_model_folder("other/model@v1", log=lambda *_: None)
    (_, rev1, first), (_, rev2, second) = calls
    published = ["config.json", "generation_config.json", "model.safetensors.index.json",
                 "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "consolidated.safetensors", "original/consolidated.00.pth", "pytorch_model.bin",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "README.md", ".gitattributes"]
    assert sorted(filter_repo_objects(published, allow_patterns=first)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json",
         "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "chat_template.jinja"])
    shards = sorted(set(json.loads((hub.export / "model.safetensors.index.json").read_text())
                        ["weight_map"].values()))
    assert (rev1, rev2, second) == ("v1", hub.commit, shards)
    # Shards in the snapshot already: no second call (with the network down, huggingface_hub
    # retries that one for some 20 s before it reads the cache).
    for name in shards:
        shutil.copy(hub.export / name, snap)
    resolve_model_folder("other/model@v1", log=lambda *_: None)
    assert len(calls) == 3


def test_push_to_hub_uploads_the_export(hub, tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi, constants

    from launch.export_hf import main

    calls = {}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.update(
        repo=(repo_id, kw)))
    monkeypatch.setattr(HfApi, "create_branch", lambda self, repo_id, **kw: calls.update(
        branch=(repo_id, kw)))

    def upload_folder(self, *, repo_id, folder_path, **kw):
        calls["upload"] = (repo_id, sorted(p.name for p in pathlib.Path(folder_path).iterdir()), kw)
        return types.SimpleNamespace(commit_url=f"https://hub.test/{repo_id}/commit/abc")

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    main(["--workdir", str(hub.tmp / "run"), "--out", str(tmp_path / "out"), "--dtype", "float32",
          "--push-to-hub", "me/tiny", "--private", "--revision", "v1"])
    assert "pushed" in capsys.readouterr().out
    assert calls["repo"] == ("me/tiny", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert calls["branch"][0] == "me/tiny" and calls["branch"][1]["branch"] == "v1"
    repo_id, files, kw = calls["upload"]
    assert repo_id == "me/tiny" and kw["revision"] == "v1"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json",
            *index["weight_map"].values()} <= set(files)
    assert any(f.endswith(".safetensors") for f in files)

    # An upload that fails leaves the export, and says how to push it again.
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: 1 / 0)
    with pytest.raises(SystemExit) as e:
        main(["--workdir", str(hub.tmp / "run"), "--out", str(tmp_path / "out2"),
              "--push-to-hub", "me/tiny"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1 and "Traceback" not in err
    assert f"hf upload me/tiny {tmp_path / 'out2'} ." in err and (tmp_path / "out2").is_dir()

    # No token: one line before anything is exported.
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    with pytest.raises(SystemExit) as e:
        main(["--workdir", str(hub.tmp / "run"), "--out", str(tmp_path / "out3"),
              "--push-to-hub", "me/tiny"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1, err
    assert "no Hugging Face token" in err and "HF_TOKEN" in err and "hf auth login" in err
    assert not (tmp_path / "out3").exists()
