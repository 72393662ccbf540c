"""launch.eval refuses, in one line and exit 2 before any checkpoint is read, what used to fail
after the model loaded: a task YAML whose `dataset_path: json` (a datasets file builder)
names no data files (68 s, then three tracebacks), and a non-positive --limit (islice's
ValueError)."""

from __future__ import annotations

import json
import pathlib
import time

import pytest

from tests.helpers.cli import assert_one_error, cli

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (the eval extra)")

TASK = """task: {name}
dataset_path: json
{kwargs}output_type: multiple_choice
test_split: test
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _tasks(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir()
    (folder / "my_json.yaml").write_text(TASK.format(name="my_json", kwargs=""))
    (folder / "data.jsonl").write_text(json.dumps(
        {"question": "1 + 1?", "choices": ["2", "3"], "answer": 0}) + "\n")
    (folder / "my_files.yaml").write_text(TASK.format(
        name="my_files", kwargs=f"dataset_kwargs:\n  data_files:\n    test: {folder}/data.jsonl\n"))
    (folder / "my_group.yaml").write_text("group: my_group\ntask:\n  - my_files\n  - my_json\n")
    return folder


def test_a_json_task_without_data_files_is_refused_before_the_model_loads(tmp_path,
                                                                          monkeypatch):
    from titanax.eval import run

    folder = _tasks(tmp_path / "tasks")

    def no_model(*_a, **_k):
        raise AssertionError("the model was loaded before the task was checked")

    monkeypatch.setattr(run, "load_model", no_model)
    import lm_eval.evaluator  # noqa: F401  (imported once per process; not the check's time)

    for tasks in (["my_json"], ["my_group"], ["titanax_tiny_mc", "my_json"]):
        t0 = time.perf_counter()
        with pytest.raises(ValueError) as e:
            run.evaluate(tmp_path / "run", tasks, include_paths=[folder])
        if tasks == ["my_json"]:  # the task index and one YAML read, no model: under 1 s
            assert time.perf_counter() - t0 < 1.0
        msg = str(e.value)
        assert "\n" not in msg and f"task 'my_json' ({folder / 'my_json.yaml'})" in msg, msg
        assert "no dataset_kwargs.data_files" in msg and "dataset_path: json" in msg, msg
    with pytest.raises(AssertionError, match="the model was loaded"):  # data_files: checked ok
        run.evaluate(tmp_path / "run", ["my_files"], include_paths=[folder])


def test_the_cli_refuses_in_one_line_exit_2(tmp_path):
    folder = _tasks(tmp_path / "tasks")
    r = cli("launch.eval", "--workdir", tmp_path / "no_run", "--tasks", "my_json",
            "--include-path", folder)
    assert_one_error(r, 2, str(folder / "my_json.yaml"), "data_files")
    for limit in ("-3", "0"):
        r = cli("launch.eval", "--workdir", tmp_path / "no_run", "--tasks", "titanax_tiny_mc",
                "--limit", limit)
        assert_one_error(r, 2, f"--limit must be >= 1 (documents a task), got {limit}")
