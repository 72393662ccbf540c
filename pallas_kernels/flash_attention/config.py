"""Block sizes and pipeline knobs of the flash attention kernels, with per-GPU defaults.

One frozen dataclass for every backend: the Triton-style grid kernels read block_q/block_kv
(forward) and block_q_bwd/block_kv_bwd (backward), num_warps and num_stages (num_stages_bwd
for the backward when set); the Mosaic GPU
kernels read the same block sizes plus max_concurrent_steps (TMA pipeline depth). In the
Mosaic backward, sm90 uses block_q_bwd query rows per warpgroup in its dq kernel and
block_kv_bwd keys per warpgroup in its dkv kernel (and streams the other one's tiles); sm100
keeps 128 resident rows per CTA (TMEM lanes) and streams block_kv_bwd (dq) or block_q_bwd (dkv)
tiles; tmem_buffers_bwd is how many X/Y score tiles its backward keeps in TMEM (2 lets the
MMAs of the next tile run while the compute warpgroup works on this one). fwd_overlap switches
the sm90 forward to FlashAttention-3's intra-warpgroup pipelining (kernel_sm90.py: the next
tile's S = Q K^T and this tile's P V stay in flight on the tensor core during the softmax, the
softmax scale folded into exp2's FMA); bwd_fused switches the sm90 backward (head_dim <= 128)
from the dq and dkv kernels to FlashAttention-3's single kernel (kernel_sm90_bwd_fused.py: S
and dP computed once per tile, dQ added with TMA reduce-adds; asynchronous, exp2 and dS under
the MMAs, at head_dim 64), and the sm100 one (head_dim <=
128) to its dkv kernel computing dQ_t = dS_t K per tile as well (kernel_sm100_bwd.fused_bwd,
the same reduce-adds); fwd_q_tiles=2 gives each sm100 forward CTA two 128-row query tiles with
a softmax warpgroup each, taking turns on the tensor core (FlashAttention-4's q_stage=2,
kernel_sm100.py); fwd_exp2_fma computes one of each key tile's 32-score slices'
exponentials with a polynomial on the FMA units instead of MUFU (FA4's exp2 emulation,
kernel_sm100.exp2_fma: a quarter of them at 128-key tiles, half at 64); fwd_p_tmem keeps
the sm100 forward's P in TMEM for the P V MMA (tcgen05 with A in TMEM) and fwd_correction (with
it) moves the O rescale to a correction warpgroup that skips it unless a row's max grew by more
than log2(256) (FA4's, kernel_sm100.py); fwd_persistent makes
the sm90 forward persistent (kernel_sm90.py: persistent_ctas CTAs, by default one per SM,
each walking output tiles longest first, the next tile's K/V and Q loads under this tile's
loop and epilogue). bwd_fused is on for the sm90 backward at head_dim 64 and 128: the SASS
audit's static bound per tile puts the fused kernel at 0.71x the dq and dkv kernels' (640 against
896 clocks at head_dim 64, 1280 against 1792 at 128; docs/attention.md), which is what issue 53
asked of it, before a GPU has timed it (the loan's sm90_bwd_fused rows, at both head dims,
time it against the split form, and a split win turns it off through measured.TUNED; the
first-contact check, titanax/train/attention_check.py, falls back to cuDNN or XLA if the
default hangs or disagrees on a run's GPU). The others are off until a GPU run measures them
(docs/attention.md).
Invalid values fail here, at construction, instead of deep inside a kernel compile.

default_config() is the shipped table below, with the knobs a GPU run measured faster on that
GPU generation (pallas_kernels/measured.py TUNED, written by `launch.gpu_check --apply` from
the choices section's A/B rows) laid over it.
"""

from __future__ import annotations

import dataclasses

from .. import measured
from ..target import compute_capability
from .backends import backend


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# `duplicates` pairs these fields with other frozen dataclasses' (backend_suite_test.Case,
# perf/tp_overlap.py, plan/efficiencies.py): named defaults alike in shape only, no logic to
# share.
@dataclasses.dataclass(frozen=True)
class FlashConfig:
    block_q: int = 128
    block_kv: int = 128
    block_q_bwd: int = 64
    block_kv_bwd: int = 64
    num_warps: int | None = None  # Triton: None = 4 for head_dim <= 64 else 8
    num_stages: int = 2  # Triton software pipelining depth
    num_stages_bwd: int | None = None  # the backward's; None = num_stages
    max_concurrent_steps: int = 2  # Mosaic: K/V (or Q/dO) tiles in flight per CTA
    tmem_buffers_bwd: int | None = None  # sm100 backward: None = 2 where TMEM's columns allow
    fwd_overlap: bool = False  # sm90 forward: FA3 intra-warpgroup overlap (GEMMs in flight)
    bwd_fused: bool = False  # sm90/sm100 backward: one kernel (dQ by TMA reduce-add)
    fwd_persistent: bool = False  # sm90 forward: one CTA per SM walking the output tiles
    persistent_ctas: int | None = None  # fwd_persistent's CTAs; None: the GPU's SM count
    fwd_q_tiles: int = 1  # sm100 forward: 128-row query tiles per CTA, a softmax WG each
    fwd_exp2_fma: bool = False  # sm100 forward: one 32-score slice per tile: exp2 on FMAs
    fwd_p_tmem: bool = False  # sm100 forward: P in TMEM for the P V MMA (tcgen05 A operand)
    fwd_correction: bool = False  # sm100 forward: FA4's correction WG, conditional rescale

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            v = getattr(self, name)
            # Triton needs power-of-two tiles and tl.dot needs >= 16 rows/cols.
            if not isinstance(v, int) or v < 16 or not _is_pow2(v):
                raise ValueError(f"FlashConfig.{name}={v!r}: must be a power of two >= 16")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"FlashConfig.num_warps={self.num_warps}: use 1, 2, 4, 8 or 16")
        for name in ("num_stages", "num_stages_bwd"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"FlashConfig.{name}={v}: must be >= 1")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"FlashConfig.max_concurrent_steps={self.max_concurrent_steps}: "
                             "the TMA pipeline needs at least 2 slots")
        if self.tmem_buffers_bwd not in (None, 1, 2):
            raise ValueError(f"FlashConfig.tmem_buffers_bwd={self.tmem_buffers_bwd!r}: use 1, 2 "
                             "or None (2 where TMEM's 512 columns allow)")
        if self.persistent_ctas is not None and (
                not isinstance(self.persistent_ctas, int) or self.persistent_ctas < 1):
            raise ValueError(f"FlashConfig.persistent_ctas={self.persistent_ctas!r}: a CTA "
                             "count >= 1, or None for one per SM of the GPU")
        for name in ("fwd_overlap", "bwd_fused", "fwd_persistent", "fwd_exp2_fma",
                     "fwd_p_tmem", "fwd_correction"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FlashConfig.{name}={getattr(self, name)!r}: use True or False")
        if self.fwd_q_tiles not in (1, 2) or isinstance(self.fwd_q_tiles, bool):
            raise ValueError(f"FlashConfig.fwd_q_tiles={self.fwd_q_tiles!r}: 1 (one softmax "
                             "warpgroup per CTA) or 2 (FlashAttention-4's two query tiles)")
        if self.fwd_correction and not self.fwd_p_tmem:
            raise ValueError("FlashConfig.fwd_correction=True needs fwd_p_tmem=True: the "
                             "correction warpgroup takes the O rescale off a softmax that "
                             "writes P into TMEM buffers of its own")
        if self.fwd_p_tmem and self.fwd_q_tiles != 1:
            raise ValueError("FlashConfig.fwd_p_tmem=True runs one query tile per CTA "
                             "(fwd_q_tiles=1): two tiles' S, O and P exceed TMEM's 512 columns")

    def check_mosaic(self) -> None:
        """wgmma/tcgen05 tiles are 64 rows per warpgroup: Mosaic needs multiples of 64."""
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            if getattr(self, name) % 64:
                raise ValueError(f"FlashConfig.{name}={getattr(self, name)}: the Mosaic GPU "
                                 "kernels need a multiple of 64")


# Per-GPU defaults. sm90 (H100/H200, 227 KiB smem per CTA): FA3's 2 consumer warpgroups x 64
# query rows, 128-key tiles double-buffered; at head_dim 256 K/V tiles shrink to 64 keys so two
# stages of K and V (4 x 64 x 256 x 2 B = 128 KiB) plus Q (64 KiB) stay under the limit.
_DEFAULTS = {
    # bwd_fused (FA3's one-kernel backward) at 64 and 128 by the static bound (docstring);
    # at 256 the backward stays the dq and dkv kernels (kernel_sm90_bwd.FUSED_MAX_HEAD_DIM).
    ("sm90", 64): FlashConfig(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=64,
                              max_concurrent_steps=3, bwd_fused=True),
    ("sm90", 128): FlashConfig(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=64,
                               max_concurrent_steps=2, bwd_fused=True),
    ("sm90", 256): FlashConfig(block_q=64, block_kv=64, block_q_bwd=64, block_kv_bwd=64,
                               max_concurrent_steps=2),
    # sm100 (B200, 227 KiB smem, 512 TMEM columns): 128 query rows per CTA (block_q is fixed
    # by TMEM's 128 lanes); SMEM holds Q (reused for the output), the K/V ring and one P tile:
    # 192 KiB at head_dim 128 with 128-key tiles and 2 stages, 208 KiB at 256 with 64-key tiles.
    ("sm100", 64): FlashConfig(block_q=128, block_kv=128, block_q_bwd=64, block_kv_bwd=64,
                               max_concurrent_steps=4),
    ("sm100", 128): FlashConfig(block_q=128, block_kv=128, block_q_bwd=64, block_kv_bwd=64,
                                max_concurrent_steps=2),
    ("sm100", 256): FlashConfig(block_q=128, block_kv=64, block_q_bwd=64, block_kv_bwd=64,
                                max_concurrent_steps=2),
    # Triton: 8 warps at every head_dim; with 4 at 64 the forward needs 255 registers per
    # thread and spills on sm_100 (ptxas, docs/attention.md).
    ("triton", 64): FlashConfig(block_q=128, block_kv=64, block_q_bwd=64, block_kv_bwd=64,
                                num_warps=8, num_stages=3),
    ("triton", 128): FlashConfig(block_q=128, block_kv=64, block_q_bwd=64, block_kv_bwd=64,
                                 num_warps=8, num_stages=2),
    # head_dim 256: the dkv kernel's resident dK and dV plus two pipelined stages of Q and dO
    # spill (255 registers); its backward runs unpipelined (169 registers).
    ("triton", 256): FlashConfig(block_q=64, block_kv=32, block_q_bwd=32, block_kv_bwd=32,
                                 num_warps=8, num_stages=2, num_stages_bwd=1),
}
# Interpret mode on CPU pays ~9 ms per grid step and nothing per tile element: few big tiles.
_INTERPRET = FlashConfig(block_q=128, block_kv=128, block_q_bwd=128, block_kv_bwd=128)


# The GPU generation each Mosaic family runs on; the portable kernel's is the target device's.
_FAMILY_MAJOR = {"sm90": 9, "sm100": 10}


def tuned_key(impl: str, head_dim: int) -> str:
    """measured.TUNED's name for the default of backend `impl` at head_dim: its config family
    and head_dim bucket (what default_config reads and gpu_check's choices write)."""
    return f"flash_attention/{backend(impl).config_family or 'triton'}/hd{_bucket(head_dim)}"


def _bucket(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def base_config(impl: str, head_dim: int) -> FlashConfig:
    """The shipped table's entry, without measured tuning."""
    return _DEFAULTS[(backend(impl).config_family or "triton", _bucket(head_dim))]


def default_config(impl: str, head_dim: int, *, interpret: bool = False) -> FlashConfig:
    if interpret and impl == "triton":
        return _INTERPRET
    family = backend(impl).config_family or "triton"
    cfg = base_config(impl, head_dim)
    if interpret:
        return cfg
    major = _FAMILY_MAJOR.get(family)
    if major is None:
        cc = compute_capability()
        major = cc[0] if cc else None
    knobs = measured.tuned(tuned_key(impl, head_dim), major)
    return dataclasses.replace(cfg, **knobs) if knobs else cfg
