"""The small model and corpus most in-process tests train (seconds on 2 cores), and runs of it."""

from __future__ import annotations

import pathlib
import shutil

import jax
import numpy as np

from titanax.config import Config, apply_overrides, load_config
from titanax.data.pipeline import build_data
from titanax.parallel.mesh import build_mesh
from titanax.train import loop
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.state import create_train_state, jit_train_step

ROOT = pathlib.Path(__file__).resolve().parents[2]


# A model and corpus small enough for seconds-long runs on 2 cores.
SMALL = {"model.d_model": 128, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_dim": 384, "model.vocab_size": 512, "train.batch_size": 8,
         "train.seq_len": 64, "train.eval_batches": 2, "data.embedded_max_bytes": 400_000,
         "mesh.data": 1}


def small_config(**extra) -> Config:
    return apply_overrides(load_config(ROOT / "configs" / "tiny.py"), {**SMALL, **extra})


QUIET = {"train.progress_bar": False, "train.log_every": 1, "train.eval_every": 0,
         "optim.warmup_steps": 2}


def seed_data(dst: pathlib.Path) -> pathlib.Path:
    """Copies a once-built tokenizer and token cache into a fresh workdir: each workdir would
    otherwise train its own (identical) BPE, the slowest part of a short run."""
    global _DATA_CACHE
    if _DATA_CACHE is None:
        import tempfile

        _DATA_CACHE = pathlib.Path(tempfile.mkdtemp(prefix="titanax_data_"))
        build_data(small_config(), _DATA_CACHE)
    dst.mkdir(parents=True, exist_ok=True)
    for p in _DATA_CACHE.iterdir():
        shutil.copy(p, dst / p.name)
    return dst


_DATA_CACHE = None


def run_small(tmp, steps, **extra):
    cfg = small_config(**{**QUIET, "train.steps": steps, **extra})
    if not tmp.exists():
        seed_data(tmp)
    lines = []
    result = loop.train(cfg, tmp, log=lines.append, devices=jax.devices()[:1])
    return result, "\n".join(str(x) for x in lines)


def tree_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def single_device_step(cfg):
    """(mesh, initial state, the train step jitted as the loop jits it) on one device."""
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    tx = make_optimizer(cfg)
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
    return mesh, state, jit_train_step(cfg, mesh, graphdef, shardings, tx, lr_schedule(cfg))
