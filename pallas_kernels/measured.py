"""What GPU runs measured, by GPU generation: where our kernels beat the vendor path (WINS),
which kernel knobs beat the shipped defaults (TUNED), and which attention kernels matched their
reference on the device (VERIFIED).

`auto` picks one of our kernels over the vendor path (cuDNN attention; XLA's FP8 dot and
scaled matmul, i.e. cuBLASLt / cuDNN) only where a benchmark recorded in docs/ showed it
faster on that GPU (`python -m launch.gpu_check`, sections attention and fp8, recorded
in docs/performance.md). A kernel that has never run on a GPU has not earned the default: until
then it stays one `impl=` away, with its tests. Add an entry here with the numbers' docs
reference when a run shows a win; remove it when a later run does not.

TUNED lays knob values over a kernel's shipped default config on one GPU generation, where the
gpu_check choices section timed them faster than the shipped values by apply.MARGIN (e.g.
('flash_attention/triton/hd64', 9): {'num_warps': 4}); flash_attention.default_config reads it.
Choices that trade accuracy (FP8 promotion) never land here.

VERIFIED names the attention kernels whose values and gradients a GPU run checked against the
reference on that GPU generation (the gpu_check kernels section: every head dim and document
layout it ran passed). A kernel `auto` would run that neither VERIFIED nor WINS records there is
checked by the run itself before its first step (titanax/train/attention_check.py, the
first-contact check), and replaced by cuDNN if it fails.

FAILED names the kernels a GPU run saw hang, crash or compute wrong values on a generation,
with or without packed documents: `auto` routes around them there.

`launch.gpu_check --apply` rewrites the four tables; by hand, keep one entry per line and a
comment naming the run.
"""

from __future__ import annotations

WHERE = "docs/performance.md"

# (op: 'attention' | 'fp8_tensorwise' | 'fp8_rowwise' | 'mxfp8', compute capability major) -> our impl that
# won there; a comment names the run that showed it.
WINS: dict[tuple[str, int], str] = {}


def ours_won(op: str, cc: tuple[int, int], impl: str) -> bool:
    return WINS.get((op, cc[0])) == impl


# (attention impl, compute capability major) -> the run that checked it against the reference
# on that GPU generation.
VERIFIED: dict[tuple[str, int], str] = {}


def verified(impl: str, cc: tuple[int, int]) -> bool:
    """Whether a GPU run of this generation recorded attention kernel `impl` matching the
    reference: checked (VERIFIED), or timed as the winner (WINS), which ran it."""
    return (impl, cc[0]) in VERIFIED or ours_won("attention", cc, impl)

# ('<attention impl>:documents' or ':causal', compute capability major) -> what a GPU run of
# that generation saw the kernel do with / without packed documents (hang, crash, values off
# the reference). `auto` never picks it there (resolve.py: cuDNN instead, or the reference in
# shard_map bodies), and no first-contact check is spent on it. `--apply` writes it from a
# run's suspects and removes an entry a later run saw pass.
FAILED: dict[tuple[str, int], str] = {}


def failed(impl: str, cc: tuple[int, int], documents: bool) -> str | None:
    """What a GPU run of this generation recorded attention kernel `impl` doing wrong with
    (documents) or without packed documents, or None."""
    return FAILED.get((f"{impl}:{'documents' if documents else 'causal'}", cc[0]))


# (config name, compute capability major) -> knob values that replace the shipped default's.
TUNED: dict[tuple[str, int], dict] = {}


def tuned(config: str, major: int | None) -> dict:
    """The measured knob values for `config` on GPU generation `major` ({} off GPU or when
    none were measured faster)."""
    return dict(TUNED.get((config, major), {})) if major is not None else {}
