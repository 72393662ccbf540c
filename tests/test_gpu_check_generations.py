"""No case of gpu_check's kernels, attention, fp8, train and choices sections fails on the grounds
of the device generation: each section's case list is built as it would be on compute capability
9.0 (H100/H200, the only GPU we are lent) and 10.0 (B200), and every case it would run is
checked against what the library itself refuses there: the kernel tables' generation, and a
trace of the very call under a GPU of that generation (fp8_matmul refuses MX scales before
Blackwell at trace time, XLA's too: the false failure this test was written for)."""

import types

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels.target as target
from pallas_kernels.flash_attention import default_config
from pallas_kernels.flash_attention.backends import backend
from pallas_kernels.flash_attention.resolve import resolve_impl, unsupported
from pallas_kernels.fp8 import fp8_matmul, quantize_mxfp8, quantize_rowwise, quantize_tensorwise
from pallas_kernels.fp8.backends import RECIPES_TABLE, matmul
from pallas_kernels.fp8.bench import case_kernel
from titanax.ops.linear import precision_refusal
from titanax.perf.gpu_check import choices, kernels, throughput, train_step
from titanax.perf.gpu_check.device import our_attention_impl
from titanax.perf.gpu_check.generation import recipe_refusal

GPUS = {(9, 0): "NVIDIA H200", (10, 0): "NVIDIA B200"}
QUANTIZE = {
    "tensorwise": lambda x, w: (*quantize_tensorwise(x), *quantize_tensorwise(w)),
    "rowwise": lambda x, w: (*quantize_rowwise(x, axis=1), *quantize_rowwise(w, axis=0)),
    "mx": lambda x, w: (*quantize_mxfp8(x, axis=1), *quantize_mxfp8(w, axis=0)),
}


@pytest.fixture(params=sorted(GPUS), ids=lambda cc: f"cc{cc[0]}.{cc[1]}")
def gpu(request, monkeypatch):
    """Every compute_capability() / target_platform() in the library answers as this GPU."""
    cc = request.param
    fake = types.SimpleNamespace(platform="gpu", compute_capability=f"{cc[0]}.{cc[1]}",
                                 device_kind=GPUS[cc], core_count=132)
    monkeypatch.setattr(target, "target_device", lambda: fake)
    return cc


def _attention_runs(impl: str, cc, head_dim: int = 128) -> None:
    """What the library knows of an attention backend on this generation: the table's
    generation, the dtype and head dim it takes."""
    need = backend(impl).compute_capability
    assert need in (None, cc[0]), f"{impl} is a {need}.x kernel, the GPU is {cc}"
    assert unsupported(impl, jnp.bfloat16, head_dim) is None


def _fp8_runs(impl: str, mode: str, cc) -> None:
    need = matmul(impl).compute_capability
    assert need in (None, cc[0]), f"fp8 {impl} is a {need}.x kernel, the GPU is {cc}"
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    w = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    # Raises what fp8_matmul refuses on this GPU (MX before Blackwell, CPU-only kernels).
    jax.eval_shape(lambda x, w: fp8_matmul(*QUANTIZE[mode](x, w), jnp.bfloat16, impl=impl),
                   x, w)


def test_kernels_section_cases(gpu):
    fp8 = kernels.fp8_cases(gpu, dry=False)
    assert len(fp8) == len(kernels.FP8_CASES)
    for impl, mode, why, _ in fp8:
        if why is None:
            _fp8_runs(impl, mode, gpu)
    na = {(impl, mode): why for impl, mode, why, _ in fp8 if why}
    if gpu[0] == 9:  # XLA's MX GEMM is n/a on Hopper, with the refusal as its reason
        assert "Blackwell" in na[("xla", "mx")] and ("sm100", "mx") in na
    else:
        assert ("xla", "mx") not in na and ("sm90", "tensorwise") in na
    ran = set()
    for impl, head_dim, _, why in kernels.attention_cases(gpu[0], dry=False):
        if why is None:
            _attention_runs(impl, gpu, head_dim)
            ran.add(impl)
    # The generation's own kernel is checked, the other generation's is not.
    assert {"mosaic_sm90": 9, "mosaic_sm100": 10}.items() >= {
        (i, gpu[0]) for i in ran if i.startswith("mosaic")}
    assert our_attention_impl() in ran


def test_attention_section_cases(gpu):
    ours = our_attention_impl()
    assert backend(ours).compute_capability == gpu[0]
    for label, attend, documents in throughput._attention_cases(ours, dry=False):
        runs = label if attend is None else resolve_impl(
            "auto", jnp.bfloat16, 128, segment_ids=documents, manual=False)
        _attention_runs(runs, gpu)


def test_fp8_section_cases(gpu):
    impls, na = throughput.fp8_impls(gpu, dry=False)
    assert impls[:3] == ["bf16", "xla_fp8", "xla_rowwise"]
    for case in impls:
        impl, mode = case_kernel(case)
        if impl is not None:
            _fp8_runs(impl, mode, gpu)
    assert ("xla_mx" in na) == (gpu[0] < 10)
    assert "pallas_grid" in na  # the CPU kernel is never timed on a GPU


def test_train_section_plan(gpu):
    ours = our_attention_impl()
    plan = train_step.train_plan(ours, dry=False)
    assert plan[:2] == [("default", "cudnn"), ("default", ours)]
    for precision, attention in plan:
        _attention_runs(attention, gpu)
        if precision in RECIPES_TABLE:
            # FP8 rows on cuDNN attention: their gain is the matmuls', and a failure of our
            # attention kernel cannot skip them.
            assert attention == "cudnn", precision
        # The section's n/a (recipe_refusal) is exactly what the trainer would refuse.
        refused = precision_refusal(precision)
        assert (refused is not None) == (recipe_refusal(precision, gpu) is not None), precision
        assert (refused is not None) == (precision == "mxfp8" and gpu[0] < 10)


def test_choices_section_cases(gpu):
    ours = our_attention_impl()
    ran = 0
    for choice in choices.CHOICES:
        if choice.generation not in (None, gpu[0]):
            continue  # recorded n/a by the section
        for var, _shipped in choices.ordered_variants(choice):
            if var.run["kind"] == "fp8":
                _fp8_runs("sm90", "tensorwise", gpu)
            else:
                impl = ours if var.run["impl"] == "ours" else var.run["impl"]
                _attention_runs(impl, gpu, var.run.get("head_dim", 128))
                if choice.tunes is not None:  # the variant's config builds on this GPU
                    assert choices.variant_config(choice, var) != default_config(
                        *choice.tunes) or _shipped
            ran += 1
    assert ran >= 6


def test_a_tuned_choice_reaches_the_config_that_runs(gpu, monkeypatch):
    """A tunable choice's row names the TUNED key that default_config reads on that GPU, so a
    variant --apply adopts is what runs afterwards (the rows once named the backend,
    'flash_attention/mosaic_sm90/hd128', where default_config reads the config family's
    'flash_attention/sm90/hd128': no Mosaic win could ever take effect)."""
    from pallas_kernels import measured
    from pallas_kernels.flash_attention.config import tuned_key

    for choice in choices.CHOICES:
        if choice.tunes is None or choice.generation not in (None, gpu[0]):
            continue
        impl, head_dim = choice.tunes
        for var, shipped in choices.ordered_variants(choice):
            if shipped or not var.knobs:
                continue
            monkeypatch.setattr(measured, "TUNED", {(tuned_key(impl, head_dim), gpu[0]):
                                                    dict(var.knobs)})
            got = default_config(impl, head_dim)
            assert all(getattr(got, k) == v for k, v in var.knobs.items()), (choice.name, var)
        monkeypatch.setattr(measured, "TUNED", {})
