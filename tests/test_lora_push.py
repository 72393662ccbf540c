"""The base a LoRA adapter export names (adapter_config.json's base_model_name_or_path and
revision) and pushing it (launch.export_hf --adapter [--base-model-id] --push-to-hub): the
import's hub id by default, a hub-cache folder read as its hub id, --base-model-id over both,
and an adapter whose base is only a folder of this machine (or none) refused before the export
when it would go to the hub. No network: the upload calls are stubbed."""

from __future__ import annotations

import json
import pathlib
import types

import pytest

from launch.export_hf import main as export_main
from tests.helpers.hf_runs import hf_small_config, make_run
from titanax.hf.source import ORIGIN_FILE, SOURCE_DIR


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_push")
    make_run(tmp / "run", hf_small_config(**{"lora.rank": 2}))
    return tmp / "run"


@pytest.fixture
def hub(monkeypatch):
    """HfApi's calls recorded instead of made; a token set."""
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: None)

    def upload_folder(self, *, repo_id, folder_path, **kw):
        config = json.loads((pathlib.Path(folder_path) / "adapter_config.json").read_text())
        calls.append((repo_id, config["base_model_name_or_path"], config["revision"]))
        return types.SimpleNamespace(commit_url=f"https://hub.test/{repo_id}/commit/abc")

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    return calls


def _origin(run: pathlib.Path, name, revision=None) -> None:
    """What launch.import_hf records (hf/source.py keep_source); name None: not imported."""
    path = run / SOURCE_DIR / ORIGIN_FILE
    if name is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"name_or_path": name, "revision": revision}) + "\n")


def _export(run, out, *flags) -> tuple[str, str]:
    export_main(["--workdir", str(run), "--out", str(out), "--adapter", *map(str, flags)])
    config = json.loads((out / "adapter_config.json").read_text())
    return config["base_model_name_or_path"], config["revision"]


def _refused(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        export_main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err


def test_the_base_named_by_default_and_by_base_model_id(run, tmp_path):
    commit = "a" * 40
    _origin(run, "meta-llama/Llama-3.1-8B", commit)  # imported by hub id
    assert _export(run, tmp_path / "a") == ("meta-llama/Llama-3.1-8B", commit)
    # the same id named again keeps the recorded commit; another id has none unless given
    assert _export(run, tmp_path / "b", "--base-model-id", "meta-llama/Llama-3.1-8B") == (
        "meta-llama/Llama-3.1-8B", commit)
    assert _export(run, tmp_path / "c", "--base-model-id", "me/base") == ("me/base", None)
    assert _export(run, tmp_path / "d", "--base-model-id", "me/base@v2") == ("me/base", "v2")
    # a folder of the hub cache (imported by path) is the snapshot of a hub id at a commit
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / commit
    _origin(run, str(snapshot))
    assert _export(run, tmp_path / "e") == ("Qwen/Qwen3-8B", commit)
    _origin(run, str(tmp_path / "models" / "llama"))  # any other folder: its path
    assert _export(run, tmp_path / "f") == (str(tmp_path / "models" / "llama"), None)


@pytest.mark.parametrize("origin", ["local", None])
def test_pushing_an_adapter_of_a_local_base_is_refused_before_the_export(
        run, tmp_path, hub, capsys, origin):
    _origin(run, str(tmp_path / "models" / "llama") if origin else None)
    out = tmp_path / "out"
    err = _refused(capsys, ["--workdir", run, "--out", out, "--adapter", "--push-to-hub",
                            "me/adapter"])
    assert err.count("error:") == 1 and "--base-model-id ORG/NAME" in err, err
    assert (str(tmp_path / "models" / "llama") if origin else "not imported") in err
    assert not out.exists() and hub == []
    # naming the base's hub id pushes it so
    export_main(["--workdir", str(run), "--out", str(out), "--adapter", "--push-to-hub",
                 "me/adapter", "--base-model-id", "me/llama-base"])
    assert hub == [("me/adapter", "me/llama-base", None)]


def test_an_adapter_imported_by_hub_id_pushes_as_it_is(run, tmp_path, hub):
    _origin(run, "meta-llama/Llama-3.1-8B", "b" * 40)
    export_main(["--workdir", str(run), "--out", str(tmp_path / "out"), "--adapter",
                 "--push-to-hub", "me/adapter"])
    assert hub == [("me/adapter", "meta-llama/Llama-3.1-8B", "b" * 40)]


def test_base_model_id_mistakes_are_one_line(run, tmp_path, capsys):
    err = _refused(capsys, ["--workdir", run, "--out", tmp_path / "x", "--adapter",
                            "--base-model-id", "/models/llama"])
    assert err.count("error:") == 1 and "give the base model's hub id as org/name" in err
    err = _refused(capsys, ["--workdir", run, "--out", tmp_path / "x", "--base-model-id",
                            "me/base"])
    assert "--base-model-id names the base of an --adapter export; add --adapter" in err
    assert not (tmp_path / "x").exists()
