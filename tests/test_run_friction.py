"""What a new user hits on the way to a run (issue 54): a --set that the saved config silently
beat, a folder that is no run trained on with configs/tiny.py, "; give --config FILE" where it
is not the fix, --help-config showing defaults for a config, a train.steps below the
checkpoint ending in "final loss nan", llama3 RoPE scaling on architectures that cannot export
it, orbax opened for a mesh refusal, and the start-up summary. The config and precedence logic
is tested as functions; the command line only where the behaviour is its own."""

from __future__ import annotations

import argparse
import pathlib

import jax
import pytest

from launch.train import _base_config
from tests.helpers.cli import CLI_SMALL, ROOT, assert_one_error, cli
from tests.helpers.small import small_config
from titanax.config import ConfigError, apply_overrides, load_config
from titanax.config.describe import describe_config
from titanax.train import loop
from titanax.train.run_log import step_line

TINY = ROOT / "configs" / "tiny.py"


def _args(workdir=None, config=None, *overrides) -> argparse.Namespace:
    return argparse.Namespace(workdir=str(workdir) if workdir else None, config=config,
                              overrides=list(overrides))


def _saved_run(workdir: pathlib.Path, **fields) -> pathlib.Path:
    """A workdir whose config.json is configs/tiny.py with fields."""
    workdir.mkdir(parents=True, exist_ok=True)
    loop.write_config_json(workdir, load_config(TINY, fields))
    return workdir


# --- 2: an explicit --set beats the saved field that would decide instead -------------------

def test_set_steps_replaces_the_saved_epochs_and_says_so(tmp_path):
    work = _saved_run(tmp_path / "run", **{"train.epochs": 5})
    notes = []
    cfg = _base_config(_args(work, None, "train.steps=50"), notes)
    assert (cfg.train.steps, cfg.train.epochs) == (50, 0.0)
    assert notes == ["--set train.steps=50 replaces the saved train.epochs=5"]
    # Both given: the user's own words, nothing replaced; without a conflict, no line.
    notes = []
    cfg = _base_config(_args(work, None, "train.steps=50", "train.epochs=2"), notes)
    assert (cfg.train.steps, cfg.train.epochs, notes) == (50, 2.0, [])
    cfg = _base_config(_args(_saved_run(tmp_path / "plain"), None, "train.steps=50"), notes)
    assert notes == [] and cfg.train.steps == 50


def test_set_warmup_steps_replaces_a_warmup_fraction(tmp_path):
    """The fine-tuning recipe of launch.import_hf saves optim.warmup_fraction=0.03, which beat
    any --set optim.warmup_steps."""
    base = load_config(TINY, {"optim.warmup_fraction": 0.03})
    notes = []
    cfg = apply_overrides(base, ["optim.warmup_steps=7"], notes=notes)
    assert (cfg.optim.warmup_steps, cfg.optim.warmup_fraction) == (7, 0.0)
    assert notes == ["--set optim.warmup_steps=7 replaces the config's optim.warmup_fraction=0.03"]


# --- 3: a folder with files but no config.json is no run ---------------------------------------

def test_a_folder_with_files_and_no_config_json_is_refused(tmp_path):
    work = tmp_path / "half_import"
    (work / "checkpoints" / "0").mkdir(parents=True)
    (work / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        _base_config(_args(work, None, *[f"{k}={v}" for k, v in CLI_SMALL.items()]))
    assert str(e.value) == (
        f"--workdir {work} holds files (checkpoints, tokenizer.json) but no config.json: not a "
        "run to continue (an import killed before it finished?), and without --config tiny.py "
        "would train there; give --config FILE to train in it, or an empty (or new) folder")
    assert _base_config(_args(work, str(TINY))).train.steps == 300  # --config: as asked
    assert_one_error(cli("launch.train", "--workdir", work), 2, "but no config.json")
    assert sorted(p.name for p in work.iterdir()) == ["checkpoints", "tokenizer.json"]
    # A new folder, an empty one, or what a refused start leaves (the lock, empty folders).
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / ".titanax.lock").write_text("{}")
    # ... and the embedded corpus's tokenizer and token cache, written before config.json.
    for name in ("tokenizer.json", "tokenizer_meta.json", "embedded_tokens_0a1b_train.npy",
                 "train.log", "slurm-run-17.out"):  # and the job's own logs
        (empty / name).write_text("{}")
    for folder in (tmp_path / "new", empty):
        assert _base_config(_args(folder)).model.arch == "llama3"


# --- 4: "; give --config FILE" only where it is the fix ---------------------------------------

def test_a_bad_set_on_a_saved_run_names_the_key_not_give_config(tmp_path):
    work = _saved_run(tmp_path / "run")
    for bad, says in (("train.stepz=5", "unknown config key 'train.stepz'. Did you mean "
                                        "'train.steps'?"),
                      ("train.steps=many", "train.steps: expected an integer, got 'many'")):
        with pytest.raises(ConfigError) as e:
            _base_config(_args(work, None, bad))
        assert str(e.value).startswith(says) and "--config" not in str(e.value), str(e.value)
    (work / "config.json").write_text("{not json")  # the saved config itself: --config fixes it
    with pytest.raises(ConfigError, match=r"is not valid JSON.*; give --config FILE$"):
        _base_config(_args(work, None, "train.steps=5"))


# --- 5: --help-config shows the config's values ------------------------------------------------

def test_help_config_lists_the_values_of_the_config_and_the_sets(tmp_path):
    cfg = load_config(TINY, ["train.steps=7", "model.arch=mixtral"])
    text = describe_config(cfg, "configs/tiny.py --set train.steps=7")
    assert text.splitlines()[0].startswith("# the values of configs/tiny.py --set train.steps=7")
    assert "  train.steps = 7  # (default 300) optimizer steps" in text
    assert "  train.batch_size = 16  # global" in text  # tiny.py's value, the default too
    assert "  model.n_experts = 8" in text and "(model.arch=mixtral adds)" not in text
    assert "  train.steps = 300  # optimizer steps" in describe_config()  # no config: defaults

    r = cli("launch.train", "--help-config", "--config", "configs/tiny.py", "--set",
            "train.steps=7")
    assert r.returncode == 0, r.stderr
    assert "  train.steps = 7  # (default 300)" in r.stdout
    assert "  optim.warmup_steps = 30" in r.stdout


# --- 7: llama3 RoPE scaling only where the Hugging Face form has it ----------------------------

@pytest.mark.parametrize("arch", ["mixtral", "mistral", "qwen3", "qwen3_moe"])
def test_plain_rope_architectures_default_to_none_and_warn_of_llama3(arch):
    # tiny.py is the Llama 3 preset, llama3 scaling: switching the architecture drops it.
    assert load_config(TINY, [f"model.arch={arch}"]).model.rope_scaling == "none"
    assert small_config(**{"model.arch": arch}).model.rope_scaling == "none"
    # An explicit llama3 (a run saved before the default changed) still loads, with a warning
    # that export will refuse it.
    with pytest.warns(UserWarning, match=rf"^model.rope_scaling='llama3': model.arch={arch} "
                      r"has plain RoPE only .*; for a new run set model.rope_scaling=none$"):
        cfg = load_config(TINY, [f"model.arch={arch}", "model.rope_scaling=llama3"])
    assert cfg.model.rope_scaling == "llama3"
    assert load_config(TINY).model.rope_scaling == "llama3"  # Llama 3 keeps its own


# --- 8: command-line refusals, one line, no orbax ----------------------------------------------

def test_host_devices_must_be_positive():
    r = cli("launch.train", "--host-devices", "-2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "argument --host-devices: must be a positive number of devices, got -2" in r.stderr


def test_a_resolved_expert_degree_refused_before_orbax_opens_anything(tmp_path):
    sets = {**CLI_SMALL, "model.arch": "mixtral", "model.n_experts": 4, "mesh.expert": -1,
            "train.batch_size": 6}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    work = tmp_path / "run"
    r = cli("launch.train", "--workdir", work, "--host-devices", 3, *args)
    assert_one_error(r, 2, "mesh.expert: 3 does not divide model.n_experts=4")
    assert not (work / "checkpoints").exists()  # orbax never ran


# --- 6 and 9: one short run -------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    cfg = small_config(**{"train.steps": 2, "train.log_every": 1, "train.eval_every": 0,
                          "train.progress_bar": False, "data.source": "synthetic"})
    lines = []
    loop.train(cfg, workdir, log=lines.append, devices=jax.devices()[:1])
    return cfg, workdir, "\n".join(map(str, lines))


def test_steps_below_the_checkpoint_are_refused_up_front(trained):
    cfg, workdir, _ = trained
    before = (workdir / "config.json").read_bytes()
    with pytest.raises(ConfigError) as e:
        loop.train(apply_overrides(cfg, {"train.steps": 1}), workdir, log=lambda *_: None,
                   devices=jax.devices()[:1])
    assert str(e.value).startswith("train.steps=1: the checkpoint is at step 2, past it "
                                   "(resumed from ")
    assert str(e.value).endswith("; to train further set train.steps above 2")
    assert (workdir / "config.json").read_bytes() == before
    # The same train.steps again (a finished run's command rerun, a requeue): nothing to do,
    # said as such, not "final loss nan, 0 tokens/s".
    lines = []
    result = loop.train(cfg, workdir, log=lines.append, devices=jax.devices()[:1])
    assert result.final_step == 2 and not result.preempted
    assert lines[-1] == ("done: nothing to train, the checkpoint is at step 2 = train.steps; to "
                         "train further set train.steps above 2")
    assert "nan" not in "\n".join(map(str, lines))


def test_start_up_summary_counts_trainable_parameters_and_says_data_once(trained):
    _, _, log = trained
    assert "data: data:" not in log
    assert "  data: synthetic (uniform random tokens" in log
    total = int(log.split(" parameters (")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert f"without the input embedding), {total:,} trainable\n" in log


def test_moe_console_line_shows_the_routing_balance():
    row = {"loss": 6.0, "tokens_per_s": 100.0, "mfu": 0.01, "step_time": 0.1,
           "skipped_steps": 0, "time": 0.0}
    assert "load" not in step_line(3, 10, row)
    moe = {**row, "aux/load_balance_loss": 2.0625, "aux/max_over_mean_load": 1.37}
    assert step_line(3, 10, moe).endswith("skipped 0 balance loss 2.062 max/mean load 1.37")
