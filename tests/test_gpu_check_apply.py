"""`python -m launch.gpu_check --apply RESULTS` (titanax.perf.gpu_check.apply): a returned
gpu_check.json becomes docs/bench/gpu_check_<gpu>.json, a section of docs/performance.md and
pallas_kernels/measured.py's wins, on a copy of the repository's own files.

The result is shaped as an H200 loan writes it (sections, rows and fields as the dry run's,
numbers invented): our sm90 attention beats cuDNN causal by 4-10%, our sm90 FP8 GEMM loses to
cuBLASLt on one of the three shapes."""

import copy
import json
import pathlib
import shutil

import pytest

import launch.gpu_check
from titanax.perf.gpu_check.apply import (
    MARGIN,
    ApplyError,
    apply,
    decide,
    tune,
    update_measured,
    verify,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES = [(8192, 8192, 8192), (8192, 8192, 28672), (8192, 28672, 8192)]


def _result() -> dict:
    attention = [{"impl": "cudnn", "seq": s, "batch": 16384 // s, "documents": False,
                  "fwd_tflops": 500.0, "bwd_tflops": 400.0, "status": "ok"}
                 for s in (8192, 4096)]
    attention += [{"impl": "mosaic_sm90", "seq": s, "batch": 16384 // s, "documents": False,
                   "fwd_tflops": 540.0, "bwd_tflops": 430.0, "vs_cudnn_causal": v,
                   "status": "ok"} for s, v in ((8192, 1.10), (4096, 1.04))]
    fp8 = []
    for (m, k, n), ratio in zip(SHAPES, (1.2, 1.1, 0.9)):
        fp8 += [{"m": m, "k": k, "n": n, "impl": "xla_fp8", "tflops": 1000.0, "status": "ok"},
                {"m": m, "k": k, "n": n, "impl": "sm90", "tflops": 1000.0 * ratio,
                 "vs_xla_fp8": ratio, "status": "ok"}]
    hd64, hd256 = "flash_attention/triton/hd64", "flash_attention/triton/hd256"
    choices = [  # as an H200 writes them once an earlier run tuned hd256 to 2 stages
        {"choice": "fp8_promotion", "variant": "promote_every=1", "shipped": True, "ms": 2.0},
        {"choice": "fp8_promotion", "variant": "promote_every=0", "shipped": False, "ms": 1.5,
         "vs_shipped": 1.33},  # faster, but an accuracy trade: never tuned
        {"choice": "triton_warps_hd64", "variant": "num_warps=8", "shipped": True, "base": True,
         "tunes": hd64, "knobs": {"num_warps": 8}, "ms": 2.0},
        {"choice": "triton_warps_hd64", "variant": "num_warps=4", "shipped": False,
         "base": False, "tunes": hd64, "knobs": {"num_warps": 4}, "ms": 1.9,
         "vs_shipped": 1.053},
        {"choice": "triton_stages_bwd_hd256", "variant": "num_stages_bwd=2", "shipped": True,
         "base": False, "tunes": hd256, "knobs": {"num_stages_bwd": 2}, "ms": 3.3},
        {"choice": "triton_stages_bwd_hd256", "variant": "num_stages_bwd=1", "shipped": False,
         "base": True, "tunes": hd256, "knobs": {"num_stages_bwd": 1}, "ms": 3.0,
         "vs_shipped": 1.1},
        {"choice": "sm100_tmem_buffers_bwd", "variant": "tmem_buffers_bwd=1", "shipped": False,
         "base": False, "tunes": "flash_attention/sm100/hd128",
         "knobs": {"tmem_buffers_bwd": 1}, "status": "n/a"},
    ]
    for row in choices:
        row.setdefault("status", "ok")
    return {
        "command": "python -m launch.gpu_check --out runs/gpu_loan --pack /out",
        "dry_run": False, "started": "2026-12-02T10:00:00", "elapsed_s": 470.0,
        "time_limit_s": 480.0, "suspects": {},
        "sections": {
            "device": {"status": "ok", "rows": [], "info": {
                "platform": "gpu", "device_kind": "NVIDIA H200", "gpu": "h200",
                "compute_capability": "9.0", "jax": "0.11.2", "cuda_plugin": "0.11.2",
                "cudnn": 91000, "cuda_driver": 13000}},
            "kernels": {"status": "fail", "rows": [
                {"kernel": "flash_attention", "impl": "mosaic_sm90", "head_dim": 128,
                 "segments": False, "status": "ok", "pass": True},
                {"kernel": "flash_attention", "impl": "mosaic_sm90", "head_dim": 128,
                 "segments": True, "status": "ok", "pass": True},
                {"kernel": "fp8_matmul", "impl": "sm90", "mode": "tensorwise",
                 "status": "fail", "pass": False, "rel": 0.02}]},
            "train": {"status": "ok", "what": "Train step", "rows": [
                {"precision": "default", "attention": "cudnn", "tokens_per_s": 3000.0,
                 "mfu": 0.45, "status": "ok"}]},
            "attention": {"status": "ok", "what": "Attention", "info": {"ours": "mosaic_sm90"},
                          "rows": attention},
            "fp8": {"status": "ok", "what": "FP8 GEMMs", "rows": fp8},
            "choices": {"status": "ok", "what": "Kernel choices", "rows": choices},
        }}


@pytest.fixture()
def repo(tmp_path):
    for rel in ("pallas_kernels/measured.py", "docs/performance.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    # A win recorded by an earlier run, for this generation and for another one.
    measured = tmp_path / "pallas_kernels" / "measured.py"
    measured.write_text(measured.read_text().replace(
        "WINS: dict[tuple[str, int], str] = {}",
        "WINS: dict[tuple[str, int], str] = {\n"
        "    ('attention', 10): 'mosaic_sm100',  # B200 2026-11-30: earlier run\n"
        "    ('fp8_tensorwise', 9): 'sm90',  # H100 2026-11-29: earlier run\n}").replace(
        "TUNED: dict[tuple[str, int], dict] = {}",
        "TUNED: dict[tuple[str, int], dict] = {\n"
        "    ('flash_attention/triton/hd256', 9): {'num_stages_bwd': 2},  # H100: earlier\n"
        "    ('flash_attention/sm100/hd128', 10): {'tmem_buffers_bwd': 1},  # B200: earlier\n}").replace(
        "VERIFIED: dict[tuple[str, int], str] = {}",
        "VERIFIED: dict[tuple[str, int], str] = {\n"
        "    ('mosaic_sm100', 10): 'B200 2026-11-30: earlier run',\n"
        "    ('triton', 9): 'H100 2026-11-29: earlier run',\n}"))
    return tmp_path


def _exec(source: str, name: str = "measured.py") -> dict:
    namespace: dict = {}
    exec(compile(source, name, "exec"), namespace)
    return namespace


def _load_measured(path: pathlib.Path) -> dict:
    return _exec(path.read_text(), str(path))


def test_apply_writes_wins_tuning_tables_and_the_result(repo, tmp_path, monkeypatch):
    result = tmp_path / "returned" / "gpu_check.json"
    result.parent.mkdir()
    result.write_text(json.dumps(_result()))
    written = apply(result, repo)
    assert sorted(p.relative_to(repo).as_posix() for p in written) == [
        "docs/bench/gpu_check_h200.json", "docs/performance.md", "pallas_kernels/measured.py"]

    # Attention won by >= MARGIN everywhere, the training length among the cases; sm90's FP8
    # lost on one shape, so the earlier Hopper win goes; Blackwell's entry is not this run's.
    measured = _load_measured(repo / "pallas_kernels" / "measured.py")
    assert measured["WINS"] == {("attention", 9): "mosaic_sm90",
                                ("attention", 10): "mosaic_sm100"}
    assert measured["ours_won"]("attention", (9, 0), "mosaic_sm90")
    source = (repo / "pallas_kernels" / "measured.py").read_text()
    assert "('attention', 9): 'mosaic_sm90',  # NVIDIA H200 2026-12-02: vs_cudnn_causal" in source
    assert "# B200 2026-11-30: earlier run" in source  # other entries keep their comments

    # Kernel defaults: 4 warps won at head_dim 64 by more than MARGIN; the shipped table's one
    # stage beat the earlier run's two at 256, so that entry goes; FP8 promotion, faster off,
    # is an accuracy trade and stays; the Blackwell entry is not this run's.
    assert measured["TUNED"] == {("flash_attention/triton/hd64", 9): {"num_warps": 4},
                                 ("flash_attention/sm100/hd128", 10): {"tmem_buffers_bwd": 1}}
    assert ("('flash_attention/triton/hd64', 9): {'num_warps': 4},  # NVIDIA H200 2026-12-02: "
            "triton_warps_hd64: num_warps=4 1.053x faster than num_warps=8") in source
    assert "# B200: earlier" in source
    # The kernels section's attention rows (both layouts) passed: sm90 is checked on Hopper
    # from now on; the portable kernel, not run this time, keeps its earlier entry.
    assert measured["VERIFIED"] == {
        ("mosaic_sm90", 9): "NVIDIA H200 2026-12-02: 2 cases matching the reference "
                            "(head_dim 128; causal, documents)",
        ("triton", 9): "H100 2026-11-29: earlier run",
        ("mosaic_sm100", 10): "B200 2026-11-30: earlier run"}
    assert measured["verified"]("mosaic_sm90", (9, 0))
    # ... and what default_config gives on each generation from then on.
    from pallas_kernels import measured as live
    from pallas_kernels.flash_attention import config
    monkeypatch.setattr(live, "TUNED", measured["TUNED"])
    assert config.default_config("triton", 64).num_warps == 8  # CPU: no GPU generation
    monkeypatch.setattr(config, "compute_capability", lambda: (9, 0))
    assert config.default_config("triton", 64).num_warps == 4
    assert config.default_config("triton", 64, interpret=True).num_warps is None
    assert config.default_config("triton", 256).num_stages_bwd == 1
    monkeypatch.setattr(config, "compute_capability", lambda: (10, 0))
    assert config.default_config("triton", 64).num_warps == 8
    assert config.default_config("mosaic_sm100", 128).tmem_buffers_bwd == 1
    assert config.default_config("mosaic_sm100", 64).tmem_buffers_bwd is None

    perf = (repo / "docs" / "performance.md").read_text()
    assert "No GPU numbers yet" not in perf
    assert "### Kernel choices (A/B)" in perf
    assert "flash_attention/triton/hd256: the shipped table (" in perf
    assert perf.count("<!-- gpu-check:h200:begin -->") == 1
    assert perf.index("## GPU: NVIDIA H200, jax 0.11.2, 2026-12-02") < perf.index("## CPU:")
    assert "| impl | seq | batch | documents | fwd_tflops |" in perf
    assert "2 of 3 cases pass:" in perf and "| sm90 | tensorwise | fail |" in perf
    assert json.loads((repo / "docs/bench/gpu_check_h200.json").read_text()) == _result()

    # A later run replaces its GPU's section, and a loss removes the win it had recorded.
    later = _result()
    for row in later["sections"]["attention"]["rows"]:
        if "vs_cudnn_causal" in row:
            row["vs_cudnn_causal"] = 0.97
    result.write_text(json.dumps(later))
    apply(result, repo)
    perf2 = (repo / "docs" / "performance.md").read_text()
    assert perf2.count("## GPU: NVIDIA H200") == 1 and "attention: vendor" in perf2
    assert _load_measured(repo / "pallas_kernels" / "measured.py")["WINS"] == {
        ("attention", 10): "mosaic_sm100"}


def _attention_row(impl, head_dim, segments, status="ok", **extra):
    return {"kernel": "flash_attention", "impl": impl, "head_dim": head_dim,
            "segments": segments, "causal": True, "status": status,
            "uses": [f"flash_attention:{impl}" + (":documents" if segments else "")],
            **({"pass": status == "ok"} if status in ("ok", "fail") else {}), **extra}


def test_verified_needs_every_case_it_ran_to_pass(repo):
    """VERIFIED: an attention kernel of this generation whose every row that ran passed; one
    with a failing or raising row, or one a section found failing or hung, is not confirmed
    and its entry goes; cases it could not run (n/a) and kernels of other generations do not
    count."""
    rep = _result()
    rep["sections"]["kernels"]["rows"] = [
        _attention_row("mosaic_sm90", 128, False), _attention_row("mosaic_sm90", 128, True),
        _attention_row("mosaic_sm90", 64, True), _attention_row("mosaic_sm90", 256, False,
                                                                "n/a", reason="budget"),
        _attention_row("triton", 128, False), _attention_row("triton", 64, True, "fail"),
        _attention_row("mosaic_sm100", 128, True, "n/a", reason="needs 10.x"),
        _attention_row("cudnn", 128, True)]
    got = verify(rep, 9)
    assert got == {"mosaic_sm90": "3 cases matching the reference (head_dim 64/128; causal, "
                                  "documents)", "triton": None}
    source = (repo / "pallas_kernels" / "measured.py").read_text()
    source = update_measured(source, {}, 9, "H200 2026-12-03", verifying=got)
    measured = _exec(source)
    assert measured["VERIFIED"] == {
        ("mosaic_sm90", 9): "H200 2026-12-03: 3 cases matching the reference (head_dim "
                            "64/128; causal, documents)",
        ("mosaic_sm100", 10): "B200 2026-11-30: earlier run"}
    assert not measured["verified"]("triton", (9, 0))
    # A kernel that passed here but hung in a later section (the run's suspects), or whose
    # kernels-section worker died in one of its cases, is not confirmed either.
    hung = copy.deepcopy(rep)
    hung["suspects"] = {"flash_attention:mosaic_sm90:documents": "timeout in section attention"}
    assert verify(hung, 9)["mosaic_sm90"] is None
    died = copy.deepcopy(rep)
    died["sections"]["kernels"]["current"] = _attention_row("mosaic_sm90", 256, True)
    assert verify(died, 9)["mosaic_sm90"] is None
    source = update_measured(source, {}, 9, "H200 2026-12-04", verifying=verify(hung, 9))
    assert ("mosaic_sm90", 9) not in _exec(source)["VERIFIED"]
    # Only this generation's kernels and the portable one: sm100's rows on Hopper are n/a.
    assert set(verify(rep, 10)) == {"triton"}


def test_decide_needs_every_case_and_the_margin():
    rep = _result()
    assert decide(rep)["attention"][0] == "mosaic_sm90"
    assert decide(rep)["fp8_tensorwise"][0] is None
    # Rowwise: sm90's case under its scaling's name against XLA's rowwise dot, on every shape.
    rowwise = copy.deepcopy(rep)
    for m, k, n in SHAPES:
        rowwise["sections"]["fp8"]["rows"] += [
            {"m": m, "k": k, "n": n, "impl": "xla_rowwise", "tflops": 900.0, "status": "ok"},
            {"m": m, "k": k, "n": n, "impl": "sm90_rowwise", "tflops": 990.0, "status": "ok"}]
    won, why = decide(rowwise)["fp8_rowwise"]
    assert won == "sm90" and why.startswith("sm90_rowwise / xla_rowwise TFLOP/s >= 1.100")
    assert decide(rowwise)["fp8_tensorwise"][0] is None  # tensorwise still lost on one shape
    short = copy.deepcopy(rep)  # the training length not measured: no verdict for a win
    short["sections"]["attention"]["rows"] = [r for r in short["sections"]["attention"]["rows"]
                                              if r["seq"] != 8192]
    assert decide(short)["attention"][0] is None
    close = copy.deepcopy(rep)  # within the noise
    for row in close["sections"]["attention"]["rows"]:
        row.setdefault("vs_cudnn_causal", None)
        if row["vs_cudnn_causal"]:
            row["vs_cudnn_causal"] = MARGIN - 0.01
    assert decide(close)["attention"][0] is None
    # Kernel knobs: a variant within MARGIN of the one running now changes nothing.
    assert tune(rep)["flash_attention/triton/hd64"][0] == {"num_warps": 4}
    for row in close["sections"]["choices"]["rows"]:
        if row.get("tunes"):
            row["ms"] = 2.0 if row["shipped"] else 2.0 / (MARGIN - 0.01)
    assert tune(close) == {}


def test_choices_tuning_one_config_merge_and_a_shipped_win_drops_only_its_knob(repo):
    """The sm90 forward's overlap and persistence and its fused backward tune one TUNED entry:
    two wins keep both knobs (the overlap turned on, the shipped fused backward turned off);
    a later run where the shipped table's value of one wins drops that knob alone."""
    key = "flash_attention/sm90/hd128"

    def row(choice, variant, knobs, ms, shipped=False, base=None):
        return {"choice": choice, "variant": variant, "shipped": shipped, "tunes": key,
                "knobs": knobs, "base": shipped if base is None else base, "ms": ms,
                "status": "ok"}

    rep = _result()
    rep["sections"]["choices"]["rows"] = [
        row("sm90_bwd_fused", "on", {"bwd_fused": True}, 3.0, shipped=True),
        row("sm90_bwd_fused", "off", {"bwd_fused": False}, 2.5),
        row("sm90_fwd_overlap", "off", {"fwd_overlap": False}, 2.0, shipped=True),
        row("sm90_fwd_overlap", "on", {"fwd_overlap": True}, 1.8)]
    knobs, why = tune(rep)[key]
    assert knobs == {"fwd_overlap": True, "bwd_fused": False}
    assert "sm90_bwd_fused: off" in why and "sm90_fwd_overlap: on" in why
    source = (repo / "pallas_kernels" / "measured.py").read_text()
    source = update_measured(source, {}, 9, "H200 2026-12-03", tune(rep))
    assert _exec(source)["TUNED"][(key, 9)] == {"bwd_fused": False, "fwd_overlap": True}
    # Later, with the split backward running (TUNED): the shipped table's fused one wins back.
    later = _result()
    later["sections"]["choices"]["rows"] = [
        row("sm90_bwd_fused", "off", {"bwd_fused": False}, 3.0, shipped=True, base=False),
        row("sm90_bwd_fused", "on", {"bwd_fused": True}, 2.5, base=True)]
    assert tune(later)[key][0] == {"bwd_fused": None}
    source = update_measured(source, {}, 9, "H200 2026-12-04", tune(later))
    assert _exec(source)["TUNED"][(key, 9)] == {"fwd_overlap": True}


def test_a_split_backward_win_turns_the_shipped_fused_one_off(repo, monkeypatch):
    """bwd_fused ships on for sm90 at head_dim 64 and 128 (the static bound): the choices rows
    built as choices_section builds them have it as the shipped variant and the table's own;
    the dq and dkv kernels winning by MARGIN write bwd_fused=False into TUNED for that head_dim
    bucket, which default_config then gives; the next loan has the split form as shipped, and
    the fused one winning back removes the entry."""
    from pallas_kernels import measured as live
    from pallas_kernels.flash_attention import config
    from titanax.perf.gpu_check import choices

    by_name = {c.name: c for c in choices.CHOICES}

    def rows(fast: bool) -> list[dict]:  # fast: which bwd_fused value is faster
        out = []
        for name in ("sm90_bwd_fused", "sm90_bwd_fused_hd64"):
            choice = by_name[name]
            for var, shipped in choices.ordered_variants(choice):
                out.append({"choice": name, "variant": var.label, "shipped": shipped,
                            "tunes": config.tuned_key(*choice.tunes), "knobs": dict(var.knobs),
                            "base": choices.is_base(choice, var), "status": "ok",
                            "ms": 2.5 if var.knobs["bwd_fused"] is fast else 3.0})
        return out

    assert {c.tunes for c in by_name.values() if c.name.startswith("sm90_bwd_fused")} == {
        ("mosaic_sm90", 128), ("mosaic_sm90", 64)}
    rep = _result()
    rep["sections"]["choices"]["rows"] = first = rows(fast=False)
    assert [(r["variant"], r["shipped"], r["base"]) for r in first[:2]] == [
        ("bwd_fused=True", True, True), ("bwd_fused=False", False, False)]
    tuning = tune(rep)
    for hd in (64, 128):
        assert tuning[f"flash_attention/sm90/hd{hd}"][0] == {"bwd_fused": False}
    source = update_measured((repo / "pallas_kernels" / "measured.py").read_text(), {}, 9,
                             "NVIDIA H200 2026-12-05", tuning)
    monkeypatch.setattr(live, "TUNED", _exec(source)["TUNED"])
    for hd in (64, 128):
        assert not config.default_config("mosaic_sm90", hd).bwd_fused
        assert config.base_config("mosaic_sm90", hd).bwd_fused  # the table keeps it on
    assert not config.default_config("mosaic_sm100", 128).bwd_fused  # Blackwell: as before
    # The next loan: the split form runs now (its shipped row), fused is the table's value.
    later = _result()
    later["sections"]["choices"]["rows"] = second = rows(fast=True)
    assert [(r["variant"], r["shipped"], r["base"]) for r in second[:2]] == [
        ("bwd_fused=False", True, False), ("bwd_fused=True", False, True)]
    for hd in (64, 128):
        assert tune(later)[f"flash_attention/sm90/hd{hd}"][0] == {"bwd_fused": None}
    source = update_measured(source, {}, 9, "NVIDIA H200 2026-12-06", tune(later))
    monkeypatch.setattr(live, "TUNED", _exec(source)["TUNED"])
    assert not [k for k in live.TUNED if k[0].startswith("flash_attention/sm90/")], live.TUNED
    assert config.default_config("mosaic_sm90", 64).bwd_fused
    assert config.default_config("mosaic_sm90", 128).bwd_fused


def test_a_variant_disagreeing_with_the_shipped_one_fails_and_is_never_adopted():
    """The choices section compares each attention variant's output and gradients with the
    shipped variant's (kernels never run on a GPU before their loan): one that disagrees fails
    its row, and --apply does not adopt it however fast it was."""
    import jax.numpy as jnp
    import numpy as np

    from titanax.perf.gpu_check.choices import AGREE_TOL, _agreement
    from titanax.perf.gpu_check.context import row_status

    rng = np.random.default_rng(0)
    arrays = tuple(jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.bfloat16)
                   for _ in range(4))
    held = {}
    assert _agreement(arrays, held, shipped=True) == {}
    close = _agreement(tuple(a * 1.01 for a in arrays), held, shipped=False)
    assert close["pass"] and max(close["vs_shipped_rel"].values()) < AGREE_TOL
    dropped = _agreement((arrays[0], arrays[1] * 0, *arrays[2:]), held, shipped=False)
    assert not dropped["pass"] and dropped["vs_shipped_rel"]["dq"] == 1.0
    nan = _agreement((*arrays[:3], arrays[3] * jnp.nan), held, shipped=False)
    assert not nan["pass"] and nan["vs_shipped_rel"]["dv"] == float("inf")
    assert _agreement(arrays, {}, shipped=False) == {}  # no shipped arrays: nothing to compare

    key = "flash_attention/sm100/hd128"
    rows = [{"choice": "sm100_bwd_fused", "variant": v, "shipped": v == "off", "tunes": key,
             "knobs": {"bwd_fused": v == "on"}, "base": v == "off", "ms": ms, **extra}
            for v, ms, extra in (("off", 3.0, {}), ("on", 1.0, dropped))]
    for r in rows:
        r["status"] = row_status(r)
    rep = _result()
    rep["sections"]["choices"]["rows"] = rows
    assert rows[1]["status"] == "fail" and tune(rep) == {}
    rows[1] = {k: v for k, v in rows[1].items() if k != "status"} | close  # agreeing now
    rows[1]["status"] = row_status(rows[1])
    assert tune(rep)[key][0] == {"bwd_fused": True}


def test_after_a_tuning_the_choices_of_its_config_still_have_a_shipped_variant(monkeypatch):
    """Variants are what runs now (TUNED included) with their knobs set: after --apply made
    fwd_overlap the sm90 hd128 default, the fused-backward choice still finds its shipped
    variant (and keeps the overlap in both), and the overlap choice's shipped one is the
    tuned value, not the table's."""
    import dataclasses

    from titanax.perf.gpu_check import choices

    tuned = dataclasses.replace(choices.base_config("mosaic_sm90", 128), fwd_overlap=True)
    monkeypatch.setattr(choices, "default_config", lambda impl, hd: (
        tuned if (impl, hd) == ("mosaic_sm90", 128) else choices.base_config(impl, hd)))
    by_name = {c.name: c for c in choices.CHOICES}
    fused = by_name["sm90_bwd_fused"]
    marked = choices.ordered_variants(fused)
    assert [(v.label, shipped) for v, shipped in marked] == [("bwd_fused=True", True),
                                                             ("bwd_fused=False", False)]
    assert all(choices.variant_config(fused, v).fwd_overlap for v, _ in marked)
    overlap = by_name["sm90_fwd_overlap"]
    (now, shipped), (other, _) = choices.ordered_variants(overlap)
    assert shipped and now.label == "fwd_overlap=True" and not choices.is_base(overlap, now)
    assert choices.is_base(overlap, other)  # winning back, it drops the knob from TUNED


def test_dry_runs_and_cpu_results_are_refused(tmp_path, repo, capsys):
    dry = dict(_result(), dry_run=True)
    path = tmp_path / "dry.json"
    path.write_text(json.dumps(dry))
    with pytest.raises(ApplyError, match="dry run"):
        apply(path, repo)
    cpu = _result()
    cpu["sections"]["device"]["info"].update(platform="cpu", gpu=None, compute_capability=None)
    path.write_text(json.dumps(cpu))
    with pytest.raises(ApplyError, match="names no known GPU"):
        apply(path, repo)
    before = (repo / "docs" / "performance.md").read_text()
    with pytest.raises(SystemExit):
        launch.gpu_check.main(["--apply", str(tmp_path / "missing.json")])
    assert "error: --apply: cannot read" in capsys.readouterr().err
    assert (repo / "docs" / "performance.md").read_text() == before


def test_a_kernel_that_hung_is_recorded_failed_and_auto_routes_around_it(repo, monkeypatch):
    """The first loan's finding (docs/performance.md): mosaic_sm90's backward with packed
    documents hung on an H200. --apply records it in FAILED for Hopper and that layout only,
    adopts no knob of that kernel, does not verify it; `auto` then sends packed documents on
    Hopper to cuDNN (dense mask) with no first-contact check, and plain causal is unchanged;
    a later run that passes the layout removes the entry."""
    import types

    import jax.numpy as jnp

    import pallas_kernels.target as target
    from pallas_kernels.flash_attention import resolve
    from titanax.perf.gpu_check.apply import failures

    rep = _result()
    rep["suspects"] = {"flash_attention:mosaic_sm90:documents":
                       "timeout in section kernels while it ran"}
    rep["sections"]["kernels"]["rows"] = [_attention_row("mosaic_sm90", 128, False),
                                          _attention_row("triton", 128, False)]
    rep["sections"]["choices"]["rows"].append(
        {"choice": "sm90_bwd_fused", "variant": "bwd_fused=False", "shipped": True,
         "base": True, "tunes": "flash_attention/sm90/hd128", "impl": "mosaic_sm90",
         "knobs": {"bwd_fused": False}, "ms": 16.0, "status": "ok"})
    rep["sections"]["choices"]["rows"].append(
        {"choice": "sm90_bwd_fused", "variant": "bwd_fused=True", "shipped": False,
         "base": False, "tunes": "flash_attention/sm90/hd128", "impl": "mosaic_sm90",
         "knobs": {"bwd_fused": True}, "ms": 15.4, "status": "ok"})
    got = failures(rep, 9)
    assert got == {"mosaic_sm90:documents": "timeout in section kernels while it ran",
                   "mosaic_sm90:causal": None, "triton:causal": None}
    assert "flash_attention/sm90/hd128" not in tune(rep)  # never from a failing kernel
    assert verify(rep, 9) == {"mosaic_sm90": None}  # triton: one layout only, no verdict
    source = (repo / "pallas_kernels" / "measured.py").read_text()
    source = update_measured(source, {}, 9, "NVIDIA H200 2026-12-04", failing=got)
    measured = _exec(source)
    assert measured["FAILED"] == {("mosaic_sm90:documents", 9): "NVIDIA H200 2026-12-04: "
                                  "timeout in section kernels while it ran"}
    assert measured["failed"]("mosaic_sm90", (9, 0), True)
    assert not measured["failed"]("mosaic_sm90", (9, 0), False)
    assert not measured["failed"]("mosaic_sm90", (10, 0), True)

    from pallas_kernels import measured as live
    monkeypatch.setattr(live, "FAILED", measured["FAILED"])
    fake = types.SimpleNamespace(platform="gpu", compute_capability="9.0", core_count=132,
                                 device_kind="NVIDIA H200")
    monkeypatch.setattr(target, "target_device", lambda: fake)
    pick = lambda **kw: resolve.resolve_impl("auto", jnp.bfloat16, 128, **kw)
    assert pick(segment_ids=True, manual=False) == "cudnn"
    assert pick(segment_ids=True, manual=False, plan=True) == "cudnn"  # nothing to check
    assert pick(segment_ids=True, manual=True) == "xla"  # no cuDNN inside shard_map
    assert pick(segment_ids=False, manual=True) == "mosaic_sm90"  # the working layout
    # A later run that ran the layout and passed removes the entry.
    fixed = failures({"suspects": {}, "sections": {"kernels": {"rows": [
        _attention_row("mosaic_sm90", 128, True)]}}}, 9)
    source = update_measured(source, {}, 9, "NVIDIA H200 2026-12-05", failing=fixed)
    assert _exec(source)["FAILED"] == {}
