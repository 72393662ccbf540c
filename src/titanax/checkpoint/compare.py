"""Does a checkpoint hold the model a config asks for? The model section of a step's saved
config compared with the run's, field by field, before the step is restored
(Checkpointer.restore_latest_good: checkpoint/fallback.py), so that a changed model is refused
in one message naming every field that differs rather than failing inside orbax on a shape.
"""

from __future__ import annotations

import dataclasses

from titanax.config import Config, ConfigError

# The lora fields that change the model (dropout acts in training only).
LORA_MODEL_FIELDS = ("rank", "alpha", "targets")


def check_same_model(saved_config: dict, cfg: Config, *, source) -> None:
    """ConfigError naming every field of the model section that differs between a checkpoint's
    config and cfg: the section is compared whole (its class is the architecture's). The
    execution section may differ (say a GPU attention kernel after a CPU run, or the
    tensor-parallel overlap the planner suggests), except where it changes what the state
    holds: fp8_delayed's amax histories."""
    saved = Config.from_dict(saved_config)
    old, new = saved.model, cfg.model
    names = dict.fromkeys(f.name for m in (old, new) for f in dataclasses.fields(m))
    diffs = [f"model.{n}: {getattr(old, n, None)!r} -> {getattr(new, n, None)!r}"
             for n in names if getattr(old, n, None) != getattr(new, n, None)]
    was, now = saved.execution, cfg.execution
    delayed = (was.matmul_precision, now.matmul_precision).count("fp8_delayed")
    if delayed == 1:
        diffs.append(f"execution.matmul_precision: {was.matmul_precision!r} -> "
                     f"{now.matmul_precision!r} (fp8_delayed keeps amax histories in the state)")
    if delayed == 2 and was.fp8_amax_history != now.fp8_amax_history:
        diffs.append(f"execution.fp8_amax_history: {was.fp8_amax_history!r} -> "
                     f"{now.fp8_amax_history!r} (the length of fp8_delayed's histories)")
    diffs += lora_diffs(saved, cfg)
    if diffs:
        raise ConfigError(
            f"the checkpoint {source} holds a different model than this config asks for "
            f"(checkpoint -> config):\n  " + "\n  ".join(diffs) + "\nSet those fields back to "
            "the checkpoint's values, or train the new model in a new --workdir.")


def lora_diffs(saved: Config, cfg: Config) -> list[str]:
    """The lora fields that differ between a checkpoint's config and cfg, as check_same_model
    lists them. None when the checkpoint holds no adapters and cfg adds them: a LoRA run
    starts from such a base (Checkpointer.base_only)."""
    was, now = saved.lora, cfg.lora
    if not was.enabled:
        return []
    return [f"lora.{n}: {getattr(was, n)!r} -> {getattr(now, n)!r}" + (
            " (a LoRA run's checkpoint holds adapters; merged export is not there yet)"
            if n == "rank" and not now.enabled else "")
            for n in LORA_MODEL_FIELDS if getattr(was, n) != getattr(now, n)]
