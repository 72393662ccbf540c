import json
import pathlib
import re

import pytest

from titanax.config import (
    EXECUTION_FIELDS,
    Config,
    ConfigError,
    ExecutionConfig,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    load_config,
)

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["tiny", "llama3_8b", "llama3_70b", "llama3_405b"])
def test_gin_and_py_build_the_same_config(name):
    assert load_config(CONFIGS / f"{name}.py") == load_config(CONFIGS / f"{name}.gin")


def test_set_overrides_coerce_types():
    cfg = load_config(CONFIGS / "tiny.py", ["train.steps=7", "optim.lr=1e-4",
                                            "data.shuffle=false", "execution.attention_impl=cudnn",
                                            "train.batch_size=4_096"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-4 and cfg.data.shuffle is False
    assert cfg.execution.attention_impl == "cudnn" and cfg.train.batch_size == 4096
    # Untouched fields keep the file's values.
    assert cfg.model.d_model == load_config(CONFIGS / "tiny.py").model.d_model


def test_overrides_apply_to_gin_configs_too():
    cfg = load_config(CONFIGS / "tiny.gin", ["model.n_layers=2"])
    assert cfg.model.n_layers == 2


@pytest.mark.parametrize("override, message", [
    ("train.step=5", "Did you mean 'train.steps'"),
    ("modle.d_model=5", "Did you mean 'model.d_model'"),
    ("train.steps=abc", "train.steps: expected an integer"),
    ("optim.lr=fast", "optim.lr: expected a number"),
    ("data.shuffle=maybe", "data.shuffle: expected a boolean"),
    ("train.steps", "expected section.field=value"),
    ("model.n_kv_heads=3", "multiple of model.n_kv_heads=3"),
    ("model.d_model=100", "not divisible by model.n_heads"),
    ("execution.attention_impl=flash", "not one of"),
    ("execution.dtype=bfloat61", "Did you mean 'bfloat16'"),
    ("train.seq_len=4096", "exceeds model.max_seq_len"),
    ("train.grad_accum=3", "divisible by train.grad_accum=3"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio: must lie in [0, 1]"),
    ("mesh.data=0", "mesh.data: must be a positive degree or -1"),
    ("train.steps=0", "train.steps: must be > 0"),
])
def test_bad_values_fail_before_anything_runs(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "tiny.py", [override])
    assert message in str(e.value)


def test_gin_errors_name_the_binding(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("model.d_modle = 3\n")
    with pytest.raises(ConfigError, match=r"d_modle.*Did you mean 'model.d_model'"):
        load_config(bad)
    bad.write_text("model.d_model = 'wide'\n")
    with pytest.raises(ConfigError, match="model.d_model: expected int, got str"):
        load_config(bad)


def test_python_config_must_define_config(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="must define config"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.py")


def test_dataclasses_are_frozen_and_typed():
    cfg = Config()
    with pytest.raises(Exception):
        cfg.train.steps = 3  # type: ignore[misc]
    with pytest.raises(ConfigError, match="train.steps: expected int"):
        TrainConfig(steps=2.5)  # type: ignore[arg-type]
    assert ModelConfig(rope_theta=10000).rope_theta == 10000.0  # ints are fine for floats


def test_round_trip_through_dict():
    cfg = apply_overrides(Config(), {"train.steps": 12, "model.n_layers": 2})
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_a_runs_config_json_is_a_config(tmp_path):
    """launch.train and launch.plan take --config WORKDIR/config.json (what a run or an HF
    import leaves): the same config, --set on top; a broken or foreign file says so."""
    import json
    import warnings

    cfg = load_config(CONFIGS / "llama3_70b.py", ["train.grad_accum=8"])
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(cfg.to_dict(), indent=2))
    assert load_config(saved) == cfg
    assert load_config(saved, ["train.batch_size=128"]).train.batch_size == 128
    d = cfg.to_dict()
    d["train"]["retired_knob"] = 1  # a field of another titanax version: left out, named
    saved.write_text(json.dumps(d))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_config(saved) == cfg
    assert "train.retired_knob" in str(caught[0].message)
    saved.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(saved)
    saved.write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))  # an HF config.json
    with pytest.raises(ConfigError, match="expected a run's config.json.*architectures"):
        load_config(saved)


def test_non_finite_numbers_and_raising_python_configs_are_one_line(tmp_path):
    for bad in ("optim.lr=nan", "optim.lr=inf", "optim.weight_decay=-inf"):
        with pytest.raises(ConfigError, match=r"must be a finite number"):
            load_config(CONFIGS / "tiny.py", [bad])
    raising = tmp_path / "broken.py"
    raising.write_text("from titanax.config import Config\n\n\ndef config():\n"
                       "    return [Config()][1]\n")
    with pytest.raises(ConfigError,
                       match=rf"^{re.escape(str(raising))}:5: IndexError: list index out of"):
        load_config(raising)
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def config(:\n    pass\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(syntax))}:1: SyntaxError"):
        load_config(syntax)


# DESIGN.md's model.* --set names: what users' scripts pass, whatever section holds the field.
DESIGN_MODEL_NAMES = {
    "arch": "qwen3", "rope_scaling": "none", "vocab_size": 1024, "d_model": 512,
    "n_layers": 3, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 1024, "rope_theta": 1e4,
    "max_seq_len": 4096, "attention_impl": "cudnn", "matmul_precision": "highest",
    "dtype": "bfloat16", "param_dtype": "bfloat16", "remat": "full", "tp_overlap": True,
    "context_strategy": "all_gather"}


@pytest.mark.filterwarnings("error::FutureWarning")  # an alias, not the old spelling
@pytest.mark.parametrize("name", sorted(DESIGN_MODEL_NAMES))
def test_every_design_model_name_still_sets_its_field(name):
    value = DESIGN_MODEL_NAMES[name]
    cfg = load_config(CONFIGS / "tiny.py", [f"model.{name}={value}"])
    section = cfg.execution if name in EXECUTION_FIELDS else cfg.model
    assert getattr(section, name) == value


def test_model_section_is_the_architectures_class_and_its_fields_are_its_own():
    from titanax.models.mistral.config import MistralConfig

    cfg = load_config(CONFIGS / "tiny.py", ["model.arch=mistral", "model.sliding_window=4096"])
    assert type(cfg.model) is MistralConfig and cfg.model.sliding_window == 4096
    assert type(Config(model=ModelConfig(arch="mistral")).model) is MistralConfig
    with pytest.raises(ConfigError, match=r"'model.sliding_window' \(llama3 has no such field\)"):
        load_config(CONFIGS / "tiny.py", ["model.sliding_window=4096"])
    with pytest.raises(ConfigError, match=r"model.sliding_window: 1024 \(below model.max_seq_len"
                                          r"=2048\) is not supported"):
        load_config(CONFIGS / "tiny.py", ["model.arch=mistral", "model.sliding_window=1024"])
    # Switching back drops a field the other class lacks only when it holds its default.
    with pytest.raises(ConfigError, match=r"model.sliding_window: llama3 has no such field"):
        apply_overrides(cfg, {"model.arch": "llama3"})


def test_configs_of_before_the_execution_section_still_load(tmp_path):
    """Python configs passing execution fields to the model section (with a FutureWarning
    naming the new spelling), gin files binding them under model, and a run's config.json
    holding them there all give the same Config as the new spelling."""
    want = load_config(CONFIGS / "tiny.py", ["execution.remat=full"])
    py = tmp_path / "old.py"
    py.write_text(CONFIGS.joinpath("tiny.py").read_text().replace(
        'model=preset("tiny"),', 'model=preset("tiny", dtype="float32", remat="full"),').replace(
        'execution=ExecutionConfig(dtype="float32"),', ""))
    with pytest.warns(FutureWarning, match=r"ExecutionConfig\(dtype=..., remat=...\)"):
        assert load_config(py) == want
    gin = tmp_path / "old.gin"
    gin.write_text(CONFIGS.joinpath("tiny.gin").read_text().replace("execution.", "model.")
                   + "model.remat = 'full'\n")
    assert load_config(gin) == want
    old = want.to_dict()
    old["model"].update(old.pop("execution"))
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert load_config(tmp_path / "config.json") == want
    with pytest.raises(ConfigError, match=r"set twice, differently: model.remat='full' vs "
                                          r"execution.remat='dots'"), pytest.warns(FutureWarning):
        Config(model=ModelConfig(remat="full"), execution=ExecutionConfig(remat="dots"))


def test_help_config_lists_every_field_with_its_default_and_one_line(capsys):
    """launch.train --help-config: every field of every section (each architecture's own
    included) as `section.field = default  # what it is`, the line from the field's comment."""
    import dataclasses

    from launch.train import main
    from titanax.archs import ARCHS
    from titanax.config import SECTIONS
    from titanax.config.model import arch_config_class

    main(["--help-config"])
    rows = {line.split(" = ")[0].strip(): line for line in capsys.readouterr().out.splitlines()
            if " = " in line}
    want = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    want |= {f"model.{f.name}" for arch in ARCHS for f in dataclasses.fields(arch_config_class(arch))}
    assert set(rows) == want
    undocumented = sorted(k for k, line in rows.items() if len(line.partition("  # ")[2]) < 8)
    assert undocumented == []
    assert rows["train.steps"].startswith("  train.steps = 300  # ")
