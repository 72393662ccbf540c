"""A small run folder with two checkpoints (CLI_SMALL's model, untrained) for the checks of the
commands that read a step's weights (tests/test_verify_readers.py, tests/test_workdir_lock.py),
and the damage those checks must catch."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

from tests.helpers.cli import CLI_SMALL, ROOT


def make_run(workdir: pathlib.Path, steps=(1, 2), *, nan_step: int | None = None) -> dict:
    """launch.train's layout: config.json, the lock file and checkpoints/<step> with their
    manifests.
    nan_step: that step's output layer is NaN (a step a run could never have saved).
    Returns the config dict."""
    import jax.numpy as jnp

    from titanax.checkpoint.manager import Checkpointer
    from titanax.config import apply_overrides, load_config
    from titanax.parallel.mesh import single_device_mesh
    from titanax.train.optim import make_optimizer
    from titanax.train.state import create_train_state

    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.gin"), CLI_SMALL)
    _, state, _ = create_train_state(cfg, single_device_mesh(), make_optimizer(cfg))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    for step in steps:
        if step == nan_step:
            out = state.weights["output"]
            out.set_value(jnp.full_like(out.get_value(), jnp.nan))
        ckpt.save(step, state.to_saved(), data_state=None, config=cfg.to_dict())
        ckpt.wait()
    ckpt.close()
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    from titanax.train.workdir_lock import workdir_lock

    with workdir_lock(workdir):  # its lock file, as a trainer leaves it
        pass
    return cfg.to_dict()


def largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def flip_into_output(step_dir: pathlib.Path) -> tuple[pathlib.Path, np.ndarray]:
    """Flips one bit in one of the step's data files (what bit rot or a bad copy does; sizes
    stay, only the checksum tells) where it lands in the output layer's stored values and
    decodes, silently, to other finite values. orbax spreads the arrays over one or more data
    files (`d/<hash>`) in no fixed order, so positions are tried in turn, file by file, until
    one changes the output layer and leaves it finite (measured: most flips inside its chunk
    do, giving weights up to 1e27-1e38 where the saved ones are below 0.1). Returns (the
    damaged file, the output layer as it now reads)."""
    from titanax.checkpoint.reader import CheckpointReader

    def output():
        return CheckpointReader(step_dir.parent, int(step_dir.name), verify=False).read(
            ("output",))

    before = output()
    files = sorted((p for p in (step_dir / "state").rglob("*")
                    if p.is_file() and p.parent.name == "d"), key=lambda p: -p.stat().st_size)
    for victim in files:
        raw = victim.read_bytes()
        # An odd stride: every byte of a float (the exponent is one of four) comes in turn.
        for i in range(0, len(raw), (len(raw) // 100) | 1):
            data = bytearray(raw)
            data[i] ^= 0x40
            victim.write_bytes(bytes(data))
            try:
                x = output()
            except Exception:  # noqa: BLE001 - a flip that breaks the decoding: the next
                continue
            if np.isfinite(x).all() and not np.array_equal(x, before):
                return victim, x
        victim.write_bytes(raw)
    raise AssertionError(f"no bit of {step_dir}'s data files decodes to other finite output "
                         "weights")


def write_into_output(step_dir: pathlib.Path, value: float = 2.6e23) -> None:
    """Writes `value` into output[0, 0] of the stored step in place (tensorstore, as orbax
    reads it): wrong finite weights with no trace in the values' shape or dtype, for a step
    without a manifest (where no checksum can tell; flip_into_output is the bit flip itself,
    on a step whose manifest sees it)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts

    from titanax.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(step_dir.parent, int(step_dir.name), verify=False)
    meta = reader._arrays[("output",)]
    info = ocp.type_handlers.ParamInfo(name=meta.name, parent_dir=pathlib.Path(meta.directory),
                                       use_zarr3=reader._use_zarr3, ts_context=reader._context)
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=reader._use_ocdbt)
    store = ts.open(spec, context=reader._context, open=True, read=True, write=True).result()
    store[0, 0].write(np.float32(value)).result()


def drop_manifest(step_dir: pathlib.Path) -> None:
    """As a step saved before manifests existed (or whose run died before its checksums)."""
    for p in step_dir.glob("titanax_manifest*"):
        p.unlink()


def copy_run(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def output_of(params) -> np.ndarray:
    return np.asarray(params["output"].get_value())
