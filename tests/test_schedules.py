"""Learning-rate schedules: wsd (warmup-stable-decay) against hand-computed values for each
decay shape, the optim fields' validation, and the run-log line a resume onto another
horizon or schedule writes (docs/schedules.md)."""

import math

import numpy as np
import pytest

from tests.helpers.small import run_small, small_config
from titanax.config import ConfigError
from titanax.train.optim import horizon_change, lr_schedule, schedule_horizon, wsd_decay_start

LR, FLOOR = 1e-3, 1e-4  # optim.lr and lr * min_lr_ratio (0.1)


def wsd(shape="linear", **extra):
    """100 steps: warmup 0..9, stable 10..79, decay over the last 20% (80..100)."""
    return small_config(**{"train.steps": 100, "optim.warmup_steps": 10, "optim.lr": LR,
                           "optim.min_lr_ratio": 0.1, "optim.schedule": "wsd",
                           "optim.decay_fraction": 0.2, "optim.decay_shape": shape, **extra})


# Hand-computed: lr * (0.1 + 0.9 * factor(p)), p = (step - 80) / 20 through the decay.
COS_QUARTER = 0.5 * (1 + math.cos(math.pi / 4))  # 0.853553...
DECAY_VALUES = {
    "linear": {85: 1e-3 * (0.1 + 0.9 * 0.75), 90: 0.55e-3, 95: 1e-3 * (0.1 + 0.9 * 0.25)},
    "cosine": {85: 1e-3 * (0.1 + 0.9 * COS_QUARTER), 90: 0.55e-3,
               95: 1e-3 * (0.1 + 0.9 * (1 - COS_QUARTER))},
    "sqrt": {85: 0.55e-3, 90: 1e-3 * (0.1 + 0.9 * (1 - math.sqrt(0.5))),
             95: 1e-3 * (0.1 + 0.9 * (1 - math.sqrt(0.75)))},
}


@pytest.mark.parametrize("shape", sorted(DECAY_VALUES))
def test_wsd_values_by_hand(shape):
    cfg = wsd(shape)
    lr = lr_schedule(cfg)
    assert wsd_decay_start(cfg) == 80
    assert float(lr(0)) == pytest.approx(LR / 10)  # warmup starts at lr / warmup_steps
    assert float(lr(5)) == pytest.approx(LR / 10 + 0.5 * (LR - LR / 10))
    for step in (10, 11, 50, 79):  # the stable phase: lr itself, not a rounding of it
        assert float(lr(step)) == np.float32(LR), step
    assert float(lr(80)) == pytest.approx(LR)  # the decay's first step, p = 0
    for step, want in DECAY_VALUES[shape].items():
        assert float(lr(step)) == pytest.approx(want, rel=1e-5), (shape, step)
    for step in (100, 150):  # the horizon and past it: the floor
        assert float(lr(step)) == pytest.approx(FLOOR, rel=1e-5)


def test_wsd_follows_decay_steps_as_its_horizon():
    cfg = wsd(**{"optim.decay_steps": 50})  # train.steps stays 100
    lr = lr_schedule(cfg)
    assert (schedule_horizon(cfg), wsd_decay_start(cfg)) == (50, 40)
    assert float(lr(39)) == np.float32(LR)
    assert float(lr(45)) == pytest.approx(0.55e-3, rel=1e-5)
    assert float(lr(50)) == pytest.approx(FLOOR, rel=1e-5)
    assert float(lr(99)) == pytest.approx(FLOOR, rel=1e-5)


def test_wsd_decay_fraction_one_decays_right_after_the_warmup():
    cfg = wsd(**{"optim.decay_fraction": 1.0})  # no stable phase: the decay spans 10..100
    lr = lr_schedule(cfg)
    assert wsd_decay_start(cfg) == 10
    assert float(lr(55)) == pytest.approx(0.55e-3, rel=1e-5)
    assert float(lr(100)) == pytest.approx(FLOOR, rel=1e-5)


def test_wsd_without_warmup_starts_at_lr():
    lr = lr_schedule(wsd(**{"optim.warmup_steps": 0}))
    assert float(lr(0)) == np.float32(LR)
    assert float(lr(90)) == pytest.approx(0.55e-3, rel=1e-5)


@pytest.mark.parametrize("override, message", [
    ({"optim.decay_fraction": 0.0}, "optim.decay_fraction: must lie in (0, 1], got 0.0"),
    ({"optim.decay_fraction": 1.5}, "optim.decay_fraction: must lie in (0, 1], got 1.5"),
    ({"optim.decay_shape": "sqr"}, "optim.decay_shape: 'sqr' is not one of"),
    ({"optim.schedule": "wsdd"}, "Did you mean 'wsd'"),
    ({"optim.schedule": "cosine", "optim.decay_fraction": 0.1},
     "optim.decay_fraction: applies only to optim.schedule=wsd (the schedule is 'cosine')"),
    ({"optim.schedule": "linear", "optim.decay_shape": "sqrt"},
     "optim.decay_shape: applies only to optim.schedule=wsd (the schedule is 'linear')"),
])
def test_bad_wsd_fields_are_one_line_naming_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        small_config(**override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_wsd_defaults_pass_under_every_schedule():
    for schedule in ("cosine", "linear", "constant", "wsd"):
        assert small_config(**{"optim.schedule": schedule}).optim.decay_fraction == 0.2


def test_horizon_change_lines():
    old = small_config(**{"train.steps": 1000})
    assert horizon_change(old, old, 400) == ""
    grown = small_config(**{"train.steps": 2000})
    assert horizon_change(old, grown, 400) == (
        "optim: the schedule's horizon changes from 1000 to 2000 steps at step 400 (train.steps "
        "grew): the learning rate from here follows the new curve; set optim.decay_steps=1000 "
        "to keep the old one")
    # decay_steps pinned to the old horizon: train.steps may grow without a new curve
    assert horizon_change(old, small_config(**{"train.steps": 2000,
                                                "optim.decay_steps": 1000}), 400) == ""
    line = horizon_change(old, small_config(**{"train.steps": 1000, "optim.decay_steps": 500}),
                          400)
    assert "from 1000 to 500 steps at step 400 (optim.decay_steps changed)" in line
    line = horizon_change(old, small_config(**{"train.steps": 1000, "optim.schedule": "wsd"}), 9)
    assert line.startswith("optim: optim.schedule changes from cosine to wsd at step 9:")
    assert "set optim.schedule=cosine to keep" in line and "\n" not in line


def test_resume_with_more_steps_says_the_horizon_changes(tmp_path):
    run_small(tmp_path, 2, **{"checkpoint.every_steps": 1})
    resumed, log = run_small(tmp_path, 4, **{"checkpoint.every_steps": 1})
    assert resumed.final_step == 4
    want = ("optim: the schedule's horizon changes from 2 to 4 steps at step 2 (train.steps "
            "grew): the learning rate from here follows the new curve; set optim.decay_steps=2 "
            "to keep the old one")
    # (the config dump's optim line is indented: only the notice starts a line with it)
    assert [line for line in log.splitlines() if line.startswith("optim:")] == [want], log


def test_resume_on_the_same_horizon_says_nothing(tmp_path):
    fixed = {"checkpoint.every_steps": 1, "optim.decay_steps": 4}  # the horizon, whatever steps
    run_small(tmp_path, 2, **fixed)
    resumed, log = run_small(tmp_path, 4, **fixed)
    assert resumed.final_step == 4 and "resumed" in log.lower()
    assert not [line for line in log.splitlines() if line.startswith("optim:")], log
