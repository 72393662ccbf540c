"""The user guides in docs/guides/ run as written. Each guide's ```bash blocks run in order in one
`bash -euo pipefail` session from the repo root, with its variables (the guide's first block,
`VAR=${VAR:-default}` lines) set through the environment to tiny values: a small model, a few
steps, data and tokenizers made here, a Hugging Face model put in an offline hub cache. ```sh
blocks are shown only (a GPU cluster, the network). `python` is this interpreter, as with the
virtual environment active."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers.cli import CLI_SMALL, ROOT
from tests.helpers.processes import free_port

GUIDES_DIR = ROOT / "docs" / "guides"
GUIDES = sorted(p.name for p in GUIDES_DIR.glob("*.md") if p.name != "README.md")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
VARIABLE = re.compile(r"^([A-Z][A-Z0-9_]*)=\$\{\1:-[^}]*\}[ \t]*(#.*)?$")
MODULE = re.compile(r"python -m (launch(?:\.\w+)+)")
TIMEOUT_S = 600

# launch.train flags that make a run tiny (tests/helpers/cli.py's, less its data.source: the
# guides give theirs): 140k parameters, 2 x 32 tokens a step, one validation batch.
TINY = {**{k: v for k, v in CLI_SMALL.items() if k != "data.source"},
        "train.progress_bar": "false", "train.log_every": 1, "train.eval_batches": 1,
        "checkpoint.async_save": "false"}


def flags(settings: dict) -> str:
    return " ".join(f"--set {k}={v}" for k, v in settings.items())


def blocks(name: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of docs/guides/NAME, in order."""
    return FENCE.findall((GUIDES_DIR / name).read_text())


def variables(name: str) -> list[str]:
    """The variables the guide's first block declares; asserts the block holds nothing else."""
    lang, body = blocks(name)[0]
    assert lang == "bash", f"{name}: the first block must be the ```bash block of variables"
    names = []
    for line in body.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            m = VARIABLE.match(line.strip())
            assert m, f"{name}: not a VAR=${{VAR:-default}} line: {line!r}"
            names.append(m.group(1))
    assert names and len(names) == len(set(names)), (name, names)
    return names


# --- what each guide needs, and what it must leave -------------------------------------------


def write_corpus(folder: pathlib.Path) -> list[str]:
    """Text files and a JSONL file of real text (titanax's config sources), as a user's corpus."""
    docs = [p.read_text() for p in sorted((ROOT / "src" / "titanax" / "config").glob("*.py"))]
    folder.mkdir(parents=True)
    for i, text in enumerate(docs[:6]):
        (folder / f"doc{i}.txt").write_text(text)
    (folder / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[6:]))
    return docs


def setup_own_data(tmp: pathlib.Path) -> dict:
    from titanax.data.tokenizer import train_bpe

    docs = write_corpus(tmp / "corpus")
    train_bpe(docs, 300, tmp / "model" / "tokenizer.json")  # stands in for a model folder's
    return {"DATA": tmp / "corpus", "TOK": tmp / "model" / "tokenizer.json",
            "SHARDS": tmp / "shards", "CONFIG": "configs/tiny.py", "WORK": tmp / "run",
            "STEPS": 3, "EXTRA": flags(TINY), "PROMPT": "def main():", "NEW_TOKENS": 8,
            "HF_OUT": tmp / "hf"}


def check_own_data(tmp: pathlib.Path, log: str) -> None:
    assert json.loads((tmp / "shards" / "meta.json").read_text())["complete"]
    assert (tmp / "run" / "checkpoints" / "3").is_dir(), log[-3000:]
    assert "[8 tokens from step 3 of" in log
    config = json.loads((tmp / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 64
    assert (tmp / "hf" / "tokenizer.json").is_file()


def setup_from_hf(tmp: pathlib.Path) -> dict:
    """A small random Llama exported to a HF folder, stored in the offline hub cache
    (HF_HOME/hub) as my-org/tiny-llama: the guide imports it by hub id, as from the hub."""
    from tests.helpers.hf_runs import hf_small_config, make_run
    from tests.helpers.hub_cache import fill_hub_cache
    from titanax.hf.exporter import export_hf

    make_run(tmp / "source_run", hf_small_config())
    export_hf(tmp / "source_run", tmp / "source_hf", dtype="float32", progress=False)
    fill_hub_cache(tmp / "hf_home" / "hub", "my-org/tiny-llama", tmp / "source_hf")
    write_corpus(tmp / "corpus")
    return {"HF": "my-org/tiny-llama", "WORK": tmp / "run", "DATA": tmp / "corpus",
            "SHARDS": tmp / "shards", "STEPS": 3, "EXTRA": flags(
                {"train.batch_size": 2, "train.progress_bar": "false", "train.log_every": 1,
                 "train.eval_batches": 1, "checkpoint.async_save": "false"}),
            "PROMPT": "def main():", "NEW_TOKENS": 8, "HF_OUT": tmp / "hf"}


def check_from_hf(tmp: pathlib.Path, log: str) -> None:
    assert "my-org/tiny-llama at commit" in log
    assert json.loads((tmp / "shards" / "meta.json").read_text())["bos"]
    assert "resumed from" in log and (tmp / "run" / "checkpoints" / "3").is_dir(), log[-3000:]
    assert "[8 tokens from step 3 of" in log
    config = json.loads((tmp / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 384
    assert (tmp / "hf" / "tokenizer.json").read_bytes() == \
        (tmp / "source_hf" / "tokenizer.json").read_bytes()


def setup_evaluate(tmp: pathlib.Path) -> dict:
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (the eval extra)")
    from tests.helpers.hf_runs import hf_small_config, make_run

    make_run(tmp / "run", hf_small_config())  # a checkpoint (step 0) and its tokenizer.json
    return {"WORK": tmp / "run", "TASKS": "titanax_tiny_gen", "LIMIT": 4, "BATCH": 4,
            "MY_TASKS": tmp / "my_tasks"}


def check_evaluate(tmp: pathlib.Path, log: str) -> None:
    results = [json.loads(p.read_text())["results"] for p in (tmp / "run" / "eval").glob("*.json")]
    tasks = {task for r in results for task in r}
    assert {"titanax_tiny_mc", "titanax_tiny_ppl", "titanax_tiny_gen", "my_qa"} <= tasks, tasks
    assert "titanax_tiny_mc {" in log and "'acc,none'" in log  # the guide's snippet's print
    (my_qa,) = [r["my_qa"] for r in results if "my_qa" in r]
    assert 0.0 <= my_qa["acc,none"] <= 1.0


def setup_multi_node(tmp: pathlib.Path) -> dict:
    rehearsal = {**TINY, "train.batch_size": 4, "data.source": "synthetic"}  # over 2 x 2 devices
    return {"CONFIG": "configs/llama3_8b.py", "GPU": "h100", "NODES": 2, "GPUS_PER_NODE": 2,
            "PLAN_OUT": tmp / "plan", "PLAN_FLAGS": "--no-compile", "WORK": tmp / "shared" / "8b",
            "REHEARSAL": tmp / "rehearsal", "PORT": free_port(), "HOST_DEVICES": 2,
            "REHEARSAL_STEPS": 3, "EXTRA": flags(rehearsal)}


def check_multi_node(tmp: pathlib.Path, log: str) -> None:
    plan = json.loads((tmp / "plan" / "plan.json").read_text())
    assert (tmp / "plan" / "plan.png").is_file()
    assert "--set mesh.fsdp=" in log and plan["search"]["best"]["overrides"]
    assert "2 processes (jax.distributed), 2 local device(s) each" in log, log[-3000:]
    assert (tmp / "rehearsal" / "checkpoints" / "3" / "titanax_manifest.json").is_file()
    assert not (tmp / "shared").exists()  # the SLURM part is shown, not run


def setup_monitor(tmp: pathlib.Path) -> dict:
    pytest.importorskip("mlflow", reason="the MLflow client is not installed (the test extra)")
    return {"CONFIG": "configs/tiny.py", "WORK": tmp / "run", "STEPS": 3, "PROFILE": "1:2",
            "EXTRA": flags({**TINY, "data.source": "synthetic"}),
            "MLFLOW_TRACKING_URI": f"file://{tmp}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true",
            "MLFLOW_EXPERIMENT_NAME": "guide-test", "PLOT": tmp / "loss.png"}


def check_monitor(tmp: pathlib.Path, log: str) -> None:
    assert "step 3: loss " in log, log[-3000:]  # the metrics.jsonl snippet
    assert (tmp / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp / "run" / "tb").glob("events.out.tfevents.*"))
    assert list((tmp / "run" / "profile").rglob("*.xplane.pb"))
    assert re.search(r"^run FINISHED \{.*'loss': ", log, re.M), log[-3000:]  # MLflow's copy
    assert (tmp / "mlruns").is_dir()


RUNS = {"own-data.md": (setup_own_data, check_own_data),
        "from-hf.md": (setup_from_hf, check_from_hf),
        "evaluate.md": (setup_evaluate, check_evaluate),
        "multi-node.md": (setup_multi_node, check_multi_node),
        "monitor.md": (setup_monitor, check_monitor)}


# --- running a guide -------------------------------------------------------------------------


def guide_env(tmp: pathlib.Path, values: dict) -> dict:
    """This environment as a user's shell with the venv active: `python` is this interpreter;
    no SLURM, coordinator or hub settings leak in; the hub and its datasets offline."""
    bindir = tmp / "bin"
    bindir.mkdir()
    wrapper = bindir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TITANAX_", "JAX_", "HF_", "WANDB_", "MLFLOW_"))}
    env.update({"PATH": f"{bindir}:{pathlib.Path(sys.executable).parent}:{env.get('PATH', '')}",
                "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "HF_HOME": str(tmp / "hf_home"),
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"})
    env.update({k: str(v) for k, v in values.items()})
    return env


def run_bash(script: pathlib.Path, env: dict, cwd: pathlib.Path = ROOT) -> tuple[int, str]:
    """bash -euo pipefail SCRIPT from the repo root (or cwd); on a timeout its whole process
    group (the guide's background processes too) is killed."""
    proc = subprocess.Popen(["bash", "-xeuo", "pipefail", str(script)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script.name} hung; output tail:\n{out[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


@pytest.mark.parametrize("name", GUIDES)
def test_guide_runs(name, tmp_path):
    assert name in RUNS, f"docs/guides/{name} has no entry in RUNS ({__file__})"
    setup, check = RUNS[name]
    values = setup(tmp_path)
    declared = variables(name)
    # Every variable gets a tiny test value: no default (a /data path, runs/...) is ever used.
    assert sorted(values) == sorted(declared), (sorted(values), declared)
    script = tmp_path / f"{pathlib.Path(name).stem}.sh"
    script.write_text("\n".join(body for lang, body in blocks(name) if lang == "bash"))
    rc, log = run_bash(script, guide_env(tmp_path, values))
    assert rc == 0, log[-6000:]
    check(tmp_path, log)


@pytest.mark.parametrize("name", GUIDES)
def test_guide_format(name):
    """Variables first, then at least one command block; every variable is named after it
    (`$VAR`, or `export VAR` for a tool that reads it from the environment)."""
    declared = variables(name)
    later = blocks(name)[1:]
    assert any(lang == "bash" for lang, _ in later), f"{name}: no ```bash command block"
    text = "\n".join(body for _, body in later)
    for var in declared:
        assert re.search(rf"\b{var}\b", text), f"{name}: {var} is declared but never used"


def test_guides_name_real_modules_and_are_indexed():
    index = (GUIDES_DIR / "README.md").read_text()
    for name in GUIDES:
        assert f"({name})" in index, f"docs/guides/README.md does not link {name}"
    for path in GUIDES_DIR.glob("*.md"):
        for module in MODULE.findall(path.read_text()):
            file = ROOT / module.replace(".", "/")
            assert file.with_suffix(".py").is_file() or (file / "__init__.py").is_file(), \
                f"{path.name}: python -m {module}: no such module"


# --- docs/fine-tuning.md, as written ----------------------------------------------------------

FINE_TUNING = ROOT / "docs" / "fine-tuning.md"
N_CHATS = 300  # a small set: its 2% validation split is a few rows, less than one batch


def reverse_chat(i: int) -> list[dict]:
    """'reverse a b c' -> 'c b a' over digits, a system message on every third."""
    import numpy as np

    rng = np.random.default_rng(i)
    words = [str(d) for d in rng.integers(0, 10, rng.integers(2, 6))]
    system = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
    return system + [{"role": "user", "content": "reverse " + " ".join(words)},
                     {"role": "assistant", "content": " ".join(reversed(words))}]


def fine_tuning_checkout(tmp: pathlib.Path) -> pathlib.Path:
    """A folder the page's commands run in as in the checkout (.venv and launch/ linked there,
    so runs/, data/ and hf/ land in tmp), with chats.jsonl of N_CHATS chats; a small random
    Llama with Llama 3's chat template stored in the offline hub cache (HF_HOME/hub) as
    meta-llama/Llama-3.1-8B-Instruct, the id the page imports."""
    from tests.helpers.chat import LLAMA3, SPECIALS, special_tokenizer
    from tests.helpers.hf_runs import hf_small_config, make_run
    from tests.helpers.hub_cache import fill_hub_cache
    from titanax.hf.exporter import export_hf

    # max_position_embeddings 256: train.seq_len 256 (the import's min(8192, it)), and room
    # for the page's 128 new tokens after a chat prompt
    make_run(tmp / "source_run", hf_small_config(**{"model.max_seq_len": 256}))
    hf = tmp / "source_hf"
    export_hf(tmp / "source_run", hf, dtype="float32", progress=False)
    special_tokenizer(hf / "tokenizer.json", "reverse 0 1 2 3 4 5 6 7 8 9 system user "
                      "assistant Answer briefly.\n")
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[0], "eos_token": "<|eot_id|>", "chat_template": LLAMA3}))
    fill_hub_cache(tmp / "hf_home" / "hub", "meta-llama/Llama-3.1-8B-Instruct", hf)
    cwd = tmp / "checkout"
    cwd.mkdir()
    for name in (".venv", "launch"):
        (cwd / name).symlink_to(ROOT / name)
    (cwd / "chats.jsonl").write_text(
        "".join(json.dumps({"messages": reverse_chat(i)}) + "\n" for i in range(N_CHATS)))
    return cwd


def test_fine_tuning_page_runs_as_written(tmp_path):
    """Every ```bash block of docs/fine-tuning.md, unchanged, on 300 chats: the import by hub
    id, prepare_data, 3 epochs (the 2% validation split is 3 rows, evaluated as one smaller
    batch), generate greedy and sampled, export."""
    pytest.importorskip("huggingface_hub")
    cwd = fine_tuning_checkout(tmp_path)
    script = tmp_path / "fine-tuning.sh"
    script.write_text("\n".join(body for lang, body in FENCE.findall(FINE_TUNING.read_text())
                                if lang == "bash"))
    rc, log = run_bash(script, guide_env(tmp_path, {}), cwd=cwd)
    assert rc == 0, log[-6000:]
    assert "meta-llama/Llama-3.1-8B-Instruct at commit" in log
    epochs = re.search(r"train\.epochs=3 -> train\.steps=(\d+) \((\d+) examples in (\d+) "
                       r"training rows of 257 tokens, train\.batch_size=16 rows a step", log)
    assert epochs, log[-6000:]
    steps, examples, rows = map(int, epochs.groups())
    assert examples == N_CHATS - N_CHATS * 2 // 100 and steps == -(-3 * rows // 16) > 3
    assert "it is evaluated as one batch of those" in log and "val_loss" in log
    assert (cwd / "runs" / "ft" / "checkpoints" / str(steps)).is_dir()
    config = json.loads((cwd / "hf" / "ft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (cwd / "hf" / "ft" / "tokenizer_config.json").is_file()
