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
from titanax.perf.gpu_check.apply import MARGIN, ApplyError, apply, decide

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
                 "status": "ok", "pass": True},
                {"kernel": "fp8_matmul", "impl": "sm90", "mode": "tensorwise",
                 "status": "fail", "pass": False, "rel": 0.02}]},
            "train": {"status": "ok", "what": "Train step", "rows": [
                {"precision": "default", "attention": "cudnn", "tokens_per_s": 3000.0,
                 "mfu": 0.45, "status": "ok"}]},
            "attention": {"status": "ok", "what": "Attention", "info": {"ours": "mosaic_sm90"},
                          "rows": attention},
            "fp8": {"status": "ok", "what": "FP8 GEMMs", "rows": fp8},
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
        "    ('fp8_tensorwise', 9): 'sm90',  # H100 2026-11-29: earlier run\n}"))
    return tmp_path


def _load_measured(path: pathlib.Path) -> dict:
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace


def test_apply_writes_wins_tables_and_the_result(repo, tmp_path):
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

    perf = (repo / "docs" / "performance.md").read_text()
    assert "No GPU numbers yet" not in perf
    assert perf.count("<!-- gpu-check:h200:begin -->") == 1
    assert perf.index("## GPU: NVIDIA H200, jax 0.11.2, 2026-12-02") < perf.index("## CPU:")
    assert "| impl | seq | batch | documents | fwd_tflops |" in perf
    assert "1 of 2 cases pass:" in perf and "| sm90 | tensorwise | fail |" in perf
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


def test_decide_needs_every_case_and_the_margin():
    rep = _result()
    assert decide(rep)["attention"][0] == "mosaic_sm90"
    assert decide(rep)["fp8_tensorwise"][0] is None
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
