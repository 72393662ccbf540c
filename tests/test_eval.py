"""launch.eval: lm-evaluation-harness on a run's checkpoint through titanax's LM adapter gives
what lm-eval's own `hf` model gives on the run's launch.export_hf folder (run in .venv-torch
through tests/torch_peer.py): the same accuracy, and every loglikelihood equal to 1e-4, on the
offline tasks shipped in src/titanax/eval/tasks (multiple choice, rolling perplexity, greedy
generation). The run is float32 end to end, restored over 8 simulated devices (tensor 2 x fsdp
4), with a 64-token context so the longer documents span several rolling windows."""

from __future__ import annotations

import json
import pathlib
import types

import numpy as np
import pytest
from torch_peer import run_jobs, torch_python

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (the eval extra)")

pytestmark = pytest.mark.usefixtures("devices8")

ROOT = pathlib.Path(__file__).resolve().parent.parent
TASKS = ["titanax_tiny_mc", "titanax_tiny_ppl", "titanax_tiny_gen"]
# init_std 0.2 makes the logits O(1), so a 1e-4 agreement means something.
SMALL = {"model.vocab_size": 320, "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
         "model.n_kv_heads": 2, "model.ffn_dim": 160, "model.max_seq_len": 64,
         "execution.init_std": 0.2, "execution.dtype": "float32", "model.param_dtype": "float32",
         "execution.matmul_precision": "highest", "train.seq_len": 32, "data.source": "synthetic",
         "mesh.data": 1, "checkpoint.async_save": False}
DOCS = ["def main():\n    return sorted(range(10))\n" * 3, "import os\nprint(os.getcwd())\n" * 5,
        "class A:\n    pass\n" * 4, "Which keyword defines a function in Python? def\n" * 3]


def make_run(workdir: pathlib.Path) -> None:
    """An untrained float32 checkpoint (step 0) and a small BPE tokenizer in `workdir`."""
    from titanax.checkpoint.manager import Checkpointer
    from titanax.config import apply_overrides, load_config
    from titanax.data.tokenizer import train_bpe
    from titanax.parallel.mesh import single_device_mesh
    from titanax.train.optim import make_optimizer
    from titanax.train.state import create_train_state

    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.py"), SMALL)
    _, state, _ = create_train_state(cfg, single_device_mesh(), make_optimizer(cfg))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    ckpt.save(0, state.to_saved(), data_state=None, config=cfg.to_dict())
    ckpt.close()
    train_bpe(DOCS, 320, workdir / "tokenizer.json")


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    """launch.eval on the run, and lm-eval's hf model on its export (one peer subprocess)."""
    torch_python()  # skips here, before any work, when the peer is missing
    from launch.eval import main
    from titanax.eval.run import TASKS_DIR
    from titanax.hf.exporter import export_hf

    tmp = tmp_path_factory.mktemp("eval")
    make_run(tmp / "run")
    main(["--workdir", str(tmp / "run"), "--tasks", ",".join(TASKS), "--batch-size", "4",
          "--log-samples"])
    (ours,) = (tmp / "run" / "eval").glob("step0-*.json")
    export_hf(tmp / "run", tmp / "export", dtype="float32", progress=False)
    run_jobs("lm_eval_peer.py", [{"dir": str(tmp / "export"), "tasks": TASKS,
                                  "include_path": str(TASKS_DIR), "batch_size": 3,
                                  "out": str(tmp / "hf.json")}], tmp)
    return types.SimpleNamespace(ours=json.loads(ours.read_text()),
                                 theirs=json.loads((tmp / "hf.json").read_text()))


def _resps(results, task):
    """Each document's filtered responses, by doc_id."""
    return {s["doc_id"]: s["filtered_resps"] for s in results["samples"][task]}


def test_multiple_choice_matches_lm_eval_hf(evals):
    ours, theirs = _resps(evals.ours, TASKS[0]), _resps(evals.theirs, TASKS[0])
    assert len(ours) == 20 and ours.keys() == theirs.keys()
    for doc in ours:
        np.testing.assert_allclose([r[0] for r in ours[doc]], [r[0] for r in theirs[doc]],
                                   rtol=0, atol=1e-4, err_msg=f"doc {doc}")
    for metric in ("acc,none", "acc_norm,none"):
        assert evals.ours["results"][TASKS[0]][metric] == evals.theirs["results"][TASKS[0]][metric]


def test_rolling_loglikelihood_matches_lm_eval_hf(evals):
    ours, theirs = _resps(evals.ours, TASKS[1]), _resps(evals.theirs, TASKS[1])
    assert len(ours) == 4 and ours.keys() == theirs.keys()
    for doc in ours:
        np.testing.assert_allclose(ours[doc], theirs[doc], rtol=0, atol=1e-4,
                                   err_msg=f"doc {doc}")
    ppl = evals.ours["results"][TASKS[1]]["word_perplexity,none"]
    assert ppl == pytest.approx(evals.theirs["results"][TASKS[1]]["word_perplexity,none"],
                                rel=1e-5)


def test_greedy_generation_matches_lm_eval_hf(evals):
    ours, theirs = _resps(evals.ours, TASKS[2]), _resps(evals.theirs, TASKS[2])
    assert len(ours) == 6 and ours == theirs
    assert any(r[0] for r in ours.values())  # generated something, not only empty strings


def test_results_name_the_checkpoint(evals):
    assert evals.ours["titanax"]["step"] == 0
    assert set(evals.ours["results"]) == set(TASKS)


def test_bad_arguments_fail_in_one_line_before_restoring(tmp_path, capsys):
    """Task names and folders are checked before the checkpoint is read (none exists here)."""
    from launch.eval import main

    cases = [(["--tasks", "titanax_tiny_mc", "--include-path", str(tmp_path / "nope")],
              "no such folder"),
             (["--tasks", "no_such_task"], "unknown task(s) ['no_such_task']"),
             (["--tasks", "titanax_tiny_mc"], "no checkpoint under"),
             (["--tasks", "titanax_tiny_mc", "--batch-size", "0"], "--batch-size must be >= 1"),
             (["--tasks", "titanax_tiny_mc", "--fewshot-as-multiturn"],
              "--fewshot-as-multiturn needs --apply-chat-template")]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["--workdir", str(tmp_path / "run"), *flags])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()  # nothing was created


def test_a_hub_task_offline_without_its_cached_dataset_is_one_line(tmp_path):
    """lm-eval's hub tasks (arc_easy) load their data with `datasets`; offline with an empty
    cache that is one error line naming the cache and the variables, not datasets' traceback."""
    import os
    import subprocess
    import sys

    make_run(tmp_path / "run")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "launch.eval", "--workdir", str(tmp_path / "run"),
                        "--tasks", "arc_easy", "--limit", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "task 'arc_easy'" in errors[0] and "HF_DATASETS_OFFLINE=1" in errors[0]
    assert str(tmp_path / "hf") in errors[0]  # the cache it looked in


def test_results_are_written_task_by_task_and_an_unwritable_folder_fails_first(
        tmp_path, monkeypatch, capsys):
    """A read-only results folder fails before any task runs (not after hours, at mkdir), and
    each task's results are on disk as soon as it finishes: a failure in the second keeps
    the first."""
    from lm_eval import evaluator

    from launch.eval import main

    make_run(tmp_path / "run")
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    real, calls = evaluator.simple_evaluate, []

    def counting(*a, **k):
        calls.append(k["tasks"])
        if len(calls) == 2:
            raise RuntimeError("the second task broke")
        return real(*a, **k)

    monkeypatch.setattr(evaluator, "simple_evaluate", counting)
    with pytest.raises(SystemExit) as exit_info:
        main(["--workdir", str(tmp_path / "run"), "--tasks", "titanax_tiny_mc",
              "--out", str(blocker / "eval")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and f"cannot write the results to {blocker}" in err
    assert "--out DIR" in err and not calls  # nothing was evaluated
    with pytest.raises(RuntimeError, match="the second task broke"):
        main(["--workdir", str(tmp_path / "run"), "--tasks", "titanax_tiny_mc,titanax_tiny_ppl",
              "--limit", "2", "--batch-size", "2"])
    (path,) = (tmp_path / "run" / "eval").glob("step0-*.json")
    kept = json.loads(path.read_text())
    assert list(kept["results"]) == ["titanax_tiny_mc"]
    assert kept["titanax"]["tasks_done"] == ["titanax_tiny_mc"]
    assert kept["titanax"]["tasks"] == ["titanax_tiny_mc", "titanax_tiny_ppl"]


def test_apply_chat_template_renders_prompts_through_the_runs_template(tmp_path, capsys):
    """--apply-chat-template (lm-eval's option) sends each prompt through the chat template
    beside the run's tokenizer, with --system-instruction as the system turn; a run without
    a template says so in one line."""
    from launch.eval import main

    make_run(tmp_path / "run")
    argv = ["--workdir", str(tmp_path / "run"), "--tasks", "titanax_tiny_mc", "--limit", "2",
            "--log-samples", "--apply-chat-template", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "has no chat template" in err, err
    (tmp_path / "run" / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}")}))
    main([*argv, "--system-instruction", "Answer."])
    (out,) = (tmp_path / "out").glob("step0-*.json")
    samples = json.loads(out.read_text())["samples"]["titanax_tiny_mc"]
    context = samples[0]["arguments"][0][0]  # (context, continuation) of the first choice
    assert context.startswith("[system] Answer.\n[user] ") and "[assistant] " in context, context
