"""Section 6: the real train step (titanax.perf.train_bench) of Llama-3-70B cut to the layers
that fit one GPU: d_model 8192, ffn 28672, 64/8 heads, head_dim 128, vocab 128256, seq 8192,
full remat, fp32 master weights and AdamW, for bf16 ('default') on cuDNN attention and on ours, and each FP8 recipe on cuDNN attention
(train_plan).

MFU as the README defines it: tokens/s x FLOPs per token / peak, FLOPs per token = 6*N +
12*L*d*S (titanax.train.throughput.flops_per_token, N the parameters without the input embedding),
peak = the GPU's dense bf16 datasheet FLOP/s (metrics.peak_flops_per_device) for every recipe,
so FP8 rows show their speed-up over bf16 as a higher MFU.
"""

from __future__ import annotations

import dataclasses
import gc
import pathlib

import jax

from pallas_kernels.flash_attention.backends import GPU_VENDOR
from pallas_kernels.fp8.api import resolve_impl as fp8_resolve_impl
from pallas_kernels.fp8.backends import RECIPES_TABLE
from pallas_kernels.target import compute_capability
from titanax.config import load_config
from titanax.perf.gpu_check.context import attention_key, fp8_key
from titanax.perf.gpu_check.device import our_attention_impl
from titanax.perf.gpu_check.generation import recipe_refusal
from titanax.perf.train_bench import bench_train_step
from titanax.train.resolved import resolve
from titanax.train.throughput import FLOP_FORMULA, flops_per_token, peak_flops_per_device

CONFIGS = pathlib.Path(__file__).resolve().parents[4] / "configs"
PRECISIONS = ("default", "fp8_tensorwise", "fp8_delayed", "mxfp8", "fp8_rowwise")
MAX_LAYERS = 4  # the step compiles one scanned layer: more layers cost memory, not compile
# Per parameter: fp32 master weight + fp32 gradient + Adam's two fp32 moments.
BYTES_PER_PARAM = 16
# Full remat at 8192 tokens keeps only layer inputs (128 MiB each); one layer's recomputed
# activations, a 1024-token chunk of logits and library workspaces fit in this.
ACTIVATION_RESERVE = 10 * 2**30
GPU = {"model.n_layers": 1, "train.batch_size": 1, "train.seq_len": 8192, "mesh.data": 1,
       "mesh.fsdp": 1, "train.grad_accum": 1}  # (the preset's is auto: launch.train's choice)
# The dry run: a model a few MB in size on the tiny config, same step, same FP8 recipes.
DRY = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
       "model.ffn_dim": 128, "model.vocab_size": 256, "train.batch_size": 2,
       "train.seq_len": 64, "mesh.data": 1, "mesh.fsdp": 1, "execution.fp8_amax_history": 4,
       "execution.attention_impl": "xla"}


def layers_that_fit(model, bytes_limit: float, spec) -> tuple[int, dict]:
    """Decoder layers (1..MAX_LAYERS) whose train state fits next to the embedding and output
    layer: (limit - 16 B x (non-layer params) - reserve) / (16 B x params per layer). spec:
    the model's (train/resolved.py)."""
    count = spec.count_params
    one = count(dataclasses.replace(model, n_layers=1))
    per_layer = count(dataclasses.replace(model, n_layers=2)) - one
    fixed = one - per_layer
    room = bytes_limit - BYTES_PER_PARAM * fixed - ACTIVATION_RESERVE
    n = int(max(1, min(MAX_LAYERS, room // (BYTES_PER_PARAM * per_layer))))
    return n, {"params_per_layer": per_layer, "params_outside_layers": fixed,
               "memory_bytes_limit": bytes_limit}


def _is_oom(row: dict) -> bool:
    err = row.get("error") or ""
    return "RESOURCE_EXHAUSTED" in err or "out of memory" in err.lower()


def _config(ctx, overrides: dict, precision: str, attention: str):
    return load_config(CONFIGS / ("tiny.py" if ctx.dry_run else "llama3_70b.py"),
                       {**overrides, "execution.matmul_precision": precision,
                        "execution.attention_impl": attention})


def _one(ctx, spec, overrides: dict, precision: str, attention: str, peak: float) -> dict:
    gc.collect()  # the previous recipe's train state (tens of GB) must be gone first
    cfg = _config(ctx, overrides, precision, attention)
    steps, warmup = (2, 1) if ctx.dry_run else (3, 1)
    r = bench_train_step(cfg, steps=steps, warmup=warmup, devices=jax.devices()[:1],
                         peak_flops=peak)
    m, t = cfg.model, cfg.train
    row = {**r.row(), "flops_per_token": flops_per_token(
        m, t.seq_len, spec.count_params(m, exclude_embedding=True)),
        "tflops_per_s": r.achieved_flops / 1e12}
    if precision != "default":
        mode = RECIPES_TABLE[precision].scaling
        row["fp8_gemm_impl"] = _fp8_auto(mode, t.batch_size * t.seq_len, m.ffn_dim, m.d_model)
    return row


def _fp8_auto(mode: str, m: int, n: int, k: int) -> str:
    """The model's FP8 GEMMs dispatch with impl='auto' (no config names one): what that picks
    here, for the record. Its rules are another file's and may change: never fail a row."""
    try:
        return fp8_resolve_impl("auto", mode, m, n, k)
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


def train_plan(ours: str, dry: bool) -> list[tuple[str, str]]:
    """(matmul precision, attention impl) per row, in measuring order. First what
    configs/llama3_70b.py runs (bf16, and attention "auto": cuDNN's causal kernel for the
    presets' unpacked data), then the same step on our attention kernel (its own row: the
    kernel that packed documents run, never run on a GPU before), then every FP8 recipe on
    cuDNN attention, so an FP8 row's gain is the matmuls' alone and a failure of our kernel
    cannot skip it. Dry run: XLA attention throughout (cuDNN's is XLA's on a CPU anyway)."""
    vendor = ours if dry else GPU_VENDOR
    return ([("default", vendor), ("default", ours)]
            + [(p, vendor) for p in PRECISIONS if p != "default"])


def train_section(ctx) -> None:
    dev = jax.devices()[0]
    # every row's model is the config file's architecture (layers aside): resolved once
    spec = resolve(_config(ctx, {}, "default", "xla")).spec
    if ctx.dry_run:
        overrides, attention = dict(DRY), "xla"
    else:
        attention = our_attention_impl()
        base = load_config(CONFIGS / "llama3_70b.py", GPU).model
        limit = (dev.memory_stats() or {}).get("bytes_limit") or 80e9
        n, why = layers_that_fit(base, limit, spec)
        overrides = {**GPU, "model.n_layers": n}
        ctx.note(layer_choice=why)
    # The README's peak: train.peak_flops, else the datasheet, else (CPU) a matmul probe, once.
    peak, source = peak_flops_per_device(
        _config(ctx, overrides, "default", attention).train.peak_flops, "bfloat16")
    ctx.note(flop_formula=FLOP_FORMULA, mfu="tokens/s * FLOPs/token / peak (dense bf16)",
             peak_flops=peak, peak_source=source, overrides=overrides)
    cc = None if ctx.dry_run else compute_capability()
    for precision, attn in train_plan(attention, ctx.dry_run):
        label = {"precision": precision, "attention": attn,
                 "n_layers": overrides["model.n_layers"],
                 "batch": overrides["train.batch_size"], "seq": overrides["train.seq_len"]}
        why = recipe_refusal(precision, cc)
        if why:
            ctx.add({**label, "status": "n/a", "reason": why})
            continue
        uses = (attention_key(attn, False),) + (
            (fp8_key("xla", RECIPES_TABLE[precision].scaling),)
            if precision != "default" else ())
        row = ctx.run_item(label, lambda: _one(ctx, spec, overrides, precision, attn, peak),
                           estimate_s=90.0, group="train", uses=uses)
        if _is_oom(row) and overrides["model.n_layers"] > 1:
            # The estimate was optimistic: one layer fewer for this and every later recipe.
            row.update(status="n/a", reason=f"out of memory at {label['n_layers']} layers; "
                                            "rerun with one fewer")
            overrides["model.n_layers"] -= 1
            ctx.note(overrides=overrides, oom_retry=label)
            label = {**label, "n_layers": overrides["model.n_layers"]}
            ctx.run_item(label, lambda: _one(ctx, spec, overrides, precision, attn, peak),
                         estimate_s=90.0, group="train", uses=uses)
