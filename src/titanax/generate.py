"""Sampling from a trained model with a KV cache: one prefill over the prompt, then one token
per step, each step a single compiled function of (params, cache, position)."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from titanax.checkpoint import integrity
from titanax.checkpoint.fallback import first_nonfinite
from titanax.checkpoint.params_only import (
    abstract_params,
    damaged,
    open_checkpoints,
    read_run_config,
    restore_params,
    sampling_mesh,
)
from titanax.config import Config, MeshConfig, PipelineConfig
from titanax.parallel.layer_order import to_logical_in_place
from titanax.train.resolved import resolve


def load_for_inference(workdir, step: int | None = None, devices=None, dtype: str | None = None,
                       *, verify: bool = True):
    """(config, graphdef, params, step) from a run folder's latest (or given) checkpoint: the
    parameters only (checkpoint/params_only.py), sharded over `devices` by the training rules
    (default: the first device; launch.generate passes all local ones); computing in `dtype`
    (default: the run's execution.dtype). Raises
    FileNotFoundError when the run has no such checkpoint, UnreadableCheckpoint when it does not
    read back, DamagedCheckpoint when its files do not match its manifest (verify: checked
    before anything is restored; a step without a manifest has its parameters checked for
    NaN and inf instead, as a resume does); creates nothing."""
    ckpt, step = open_checkpoints(pathlib.Path(workdir) / "checkpoints", step, verify=verify)
    unverified = verify and integrity.load_manifest(ckpt.step_dir(step)) is None
    try:
        run_cfg = read_run_config(ckpt, step)
        # The arrays' shapes do not depend on the layout that trained the model, only (circular
        # pipelines) the stored order of the layers. Host offload is a training memory option:
        # sampling keeps everything on the devices.
        cfg = dataclasses.replace(run_cfg, mesh=MeshConfig(), pipeline=PipelineConfig(),
                                  train=dataclasses.replace(run_cfg.train, offload_optimizer=False,
                                                            offload_params=False))
        if dtype is not None:
            cfg = dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, dtype=dtype))
        mesh = sampling_mesh(cfg, jax.devices()[:1] if devices is None else devices)
        graphdef, abstract = abstract_params(cfg, mesh, resolve(cfg).spec)
        params = restore_params(ckpt, step, abstract, verify=verify)
        if unverified and (bad := first_nonfinite(params)):
            raise damaged(ckpt, step, f"it has no manifest and its parameter {bad} holds "
                          "NaN or inf")
    finally:
        ckpt.close()
    params["layers"] = to_logical_in_place(params["layers"], run_cfg)
    return cfg, graphdef, params, step


def find_tokenizer(cfg: Config, workdir) -> pathlib.Path | None:
    """The tokenizer the run's config names, as training reads it (data/tokenizer.py
    load_or_train): data.tokenizer; else its shard folder's copy (a mixture's folders all
    share one); else the workdir's own (trained there on the embedded corpus). A
    tokenizer.json that happens to lie in the workdir never overrides what the config names
    (an imported run's config names the imported tokenizer)."""
    if cfg.data.tokenizer:
        candidates = [pathlib.Path(cfg.data.tokenizer)]
    else:
        candidates = [pathlib.Path(folder) / "tokenizer.json"
                      for folder, _ in cfg.data.folders()]
        candidates.append(pathlib.Path(workdir) / "tokenizer.json")
    return next((p for p in candidates if p.is_file()), None)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _forward(graphdef, params, tokens_BS, cache, cache_index):
    model = nnx.merge(graphdef, params)
    logits_BSV, cache = model(tokens_BS, cache=cache, cache_index=cache_index)
    return logits_BSV[:, -1].astype(jnp.float32), cache


def sampling_logits(logits_BV, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The logits sampling draws from, as transformers' warpers make them (in its order:
    temperature, top-k, top-p): divided by the temperature; outside the top_k largest
    (0: all) -inf; outside the smallest set of most likely tokens whose probability reaches
    top_p (1: all; the most likely token always stays) -inf."""
    logits_BV = logits_BV / temperature
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth = jax.lax.top_k(logits_BV, top_k)[0][..., -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    if top_p < 1.0:
        order_BV = jnp.argsort(-logits_BV, axis=-1)
        probs_BV = jax.nn.softmax(jnp.take_along_axis(logits_BV, order_BV, axis=-1), axis=-1)
        # a token stays while the tokens more likely than it hold less than top_p
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        drop_BV = jnp.zeros_like(before_BV, bool).at[
            jnp.arange(logits_BV.shape[0])[:, None], order_BV].set(before_BV >= top_p)
        logits_BV = jnp.where(drop_BV, -jnp.inf, logits_BV)
    return logits_BV


def _sample(logits_BV, key, temperature: float, top_k: int = 0, top_p: float = 1.0):
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1)
    return jax.random.categorical(key, sampling_logits(logits_BV, temperature, top_k, top_p),
                                  axis=-1)


def generate(cfg: Config, graphdef, params, prompt_ids: list[int], *, max_new_tokens: int,
             temperature: float = 0.0, seed: int = 0, eos_id=None, top_k: int = 0,
             top_p: float = 1.0):
    """Yields new token ids one at a time (stops at eos or max_new_tokens). eos_id: one id or
    several (an Instruct model ends a turn with <|eot_id|> as well as <|end_of_text|>).
    temperature 0: greedy; else sampled from sampling_logits (top_k, top_p)."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty prompt")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: every token), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1: every token), got {top_p}")
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.model.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                         f"({max_new_tokens}) exceeds model.max_seq_len={cfg.model.max_seq_len}")
    cache = resolve(cfg).spec.init_cache(cfg.model, 1, total, cfg.execution.dtype)
    key = jax.random.key(seed)
    logits, cache = _forward(graphdef, params, jnp.asarray([prompt_ids], jnp.int32), cache,
                             jnp.int32(0))
    pos = len(prompt_ids)
    stop = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    for _ in range(max_new_tokens):
        key, sub = jax.random.split(key)
        token = int(_sample(logits, sub, temperature, top_k, top_p)[0])
        if token in stop:
            return
        yield token
        logits, cache = _forward(graphdef, params, jnp.asarray([[token]], jnp.int32), cache,
                                 jnp.int32(pos))
        pos += 1
