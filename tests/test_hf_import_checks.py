"""What crosses the Hugging Face boundary is checked, and a failure is one line: a tensor holding
NaN or inf is refused by launch.import_hf naming it (exit 2, nothing written); a full disk
during an import or an export ends in one line and exit 1 (tests/test_disk_full.py's way of
making a disk full); a tokenizer without an end-of-document token is left behind with one
line saying so (hf/tokenizer.py tokenizer_refusal says why not a refusal). The HF folder is a
titanax export (no transformers needed)."""

from __future__ import annotations

import errno
import json
import shutil

import numpy as np
import pytest

from tests.helpers.cli import one_error_line
from tests.helpers.hf_runs import hf_small_config, make_run


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from titanax.hf.exporter import export_hf

    tmp = tmp_path_factory.mktemp("hfcheck")
    make_run(tmp / "run", hf_small_config())
    export_hf(tmp / "run", tmp / "hf", dtype="float32", progress=False)
    return tmp / "hf"


def _one_error(capsys, exit_info, code: int, *contains: str) -> str:
    return one_error_line(capsys.readouterr().err, exit_info.value.code, code, *contains)


def test_nan_or_inf_in_imported_weights_is_refused_naming_the_tensor(hf_folder, tmp_path,
                                                                      capsys):
    from safetensors.numpy import load_file, save_file

    from launch.import_hf import main

    bad = tmp_path / "hf"
    shutil.copytree(hf_folder, bad)
    name = "model.layers.1.mlp.down_proj.weight"
    f = next(p for p in bad.glob("*.safetensors") if name in load_file(str(p)))
    tensors = load_file(str(f))
    tensors[name][3, 5] = np.inf
    tensors[name][0, 0] = np.nan
    save_file(tensors, str(f), metadata={"format": "pt"})
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as exit_info:
        main(["--hf", str(bad), "--workdir", str(work)])
    _one_error(capsys, exit_info, 2, f"{f}: tensor {name} holds NaN or inf (2 of 10240 values)",
               "nothing was imported")
    assert not work.exists()


def test_a_full_disk_during_import_or_export_is_one_line(hf_folder, tmp_path, capsys,
                                                         monkeypatch):
    from launch import export_hf, import_hf
    from titanax.checkpoint import manager
    from titanax.hf import safetensors_io

    real = shutil.disk_usage
    with monkeypatch.context() as m:
        m.setattr(manager.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
        with pytest.raises(SystemExit) as exit_info:
            import_hf.main(["--hf", str(hf_folder), "--workdir", str(tmp_path / "work")])
    _one_error(capsys, exit_info, 1, "disk full: the checkpoint of step 0 does not fit in",
               "1.0 kB are free there")
    assert not any((tmp_path / "work" / "checkpoints").iterdir())  # no partial step

    import_hf.main(["--hf", str(hf_folder), "--workdir", str(tmp_path / "run")])
    capsys.readouterr()

    def full(self, name, array):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    with monkeypatch.context() as m:
        m.setattr(safetensors_io.StreamingWriter, "write", full)
        with pytest.raises(SystemExit) as exit_info:
            export_hf.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    _one_error(capsys, exit_info, 1, "disk full writing", "No space left on device",
               "nothing was written to")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "work"]  # no partial export


def test_a_tokenizer_without_end_of_document_token_is_named_in_one_line(hf_folder, tmp_path,
                                                                         capsys):
    from launch.import_hf import main

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    tok = folder / "tokenizer.json"
    tok.write_text(tok.read_text().replace("<|end_of_text|>", "<|turn_end|>"))
    work = tmp_path / "work"
    main(["--hf", str(folder), "--workdir", str(work)])
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, out
    assert "the tokenizer is not imported" in warnings[0], warnings[0]
    assert "has no end-of-document token" in warnings[0] and "--tokenizer PATH" in warnings[0]
    assert (work / "checkpoints" / "0").is_dir() and not (work / "hf_tokenizer").exists()
    assert not json.loads((work / "config.json").read_text())["data"]["tokenizer"]
