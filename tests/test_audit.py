"""The audit of the compiled step (plan/audit.py, perf/hlo_flops.py) on small deviceless H100
compiles, made once in one subprocess: it fails a cuDNN attention fed a dense mask (and the
mask's S x S array) and a dot XLA emits as a loop fusion; it passes causal cuDNN attention
beside library GEMMs and our Mosaic kernels, with their FLOPs from the arithmetic; it counts
FLOPs through nested scans by their trip counts (known_trip_count, or the loop condition's
constant); the expected FLOPs follow the documented formula; plan.json and launch.plan
--audit carry it."""

from __future__ import annotations

import json
import re

import pytest

from pallas_kernels import aot
from titanax.plan import audit as A

B, S, H, D = 1, 256, 4, 64          # attention examples
WIDTH = 2048                        # the projection in front of the causal attention
LOOP_N = 1024                       # int32 [N, N] @ [N, N]: XLA's loop emitter (wrapped_dot)
SCAN_OUTER, SCAN_INNER, M, K = 3, 2, 512, 1024  # nested scans of [M, K] @ [K, K]

SCRIPT = r"""
import json, sys, jax, jax.numpy as jnp
from pallas_kernels import aot
from pallas_kernels.flash_attention import flash_attention
B, S, H, D, WIDTH, LOOP_N, OUTER, INNER, M, K = (int(x) for x in sys.argv[1:11])
mesh = aot.gpu_mesh("h100")

def text(fn, *shapes, **options):
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, dt, sharding=sh) for s, dt in shapes]
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*args).compile(compiler_options=options).as_text()

def attention_grad(attention=jax.nn.dot_product_attention, **kw):
    def loss(q, k, v):
        return attention(q, k, v, **kw).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))

def projected_causal(x, w):  # a GEMM in front of causal attention, forward and backward
    def loss(x, w):
        q = (x @ w).reshape(B, S, WIDTH // D, D)
        o = jax.nn.dot_product_attention(q, q, q, implementation="cudnn", is_causal=True)
        return o.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1))(x, w)

def nested(x, w):
    def outer(c, x_MK):
        h_MK, _ = jax.lax.scan(lambda h, w_KK: (jnp.tanh(h @ w_KK), None), x_MK, w)
        return c + h_MK.astype(jnp.float32).sum(), None
    return jax.lax.scan(outer, 0.0, x)[0]

bf = jnp.bfloat16
qkv = [((B, S, H, D), bf)] * 3
out = {
    "dense": text(attention_grad(implementation="cudnn",
                                 mask=jnp.tril(jnp.ones((S, S), bool))[None, None]), *qkv),
    "mosaic": text(attention_grad(flash_attention, causal=True,
                                  impl="mosaic_sm90"), *qkv),
    # without Triton GEMMs XLA calls cuBLAS(Lt) for the projection and its two gradients
    "causal_gemm": text(projected_causal, ((B, S, WIDTH), bf), ((WIDTH, WIDTH), bf),
                        xla_gpu_enable_triton_gemm=False),
    "loop_dot": text(lambda a, b: jax.lax.dot(a, b), *[((LOOP_N, LOOP_N), jnp.int32)] * 2),
    "scan": text(nested, ((OUTER, M, K), bf), ((INNER, K, K), bf)),
}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def hlo() -> dict[str, str]:
    if not aot.plugin_available():
        pytest.skip("CUDA plugin not installed in .venv/cuda-plugin (`bash scripts/dev.sh cuda-plugin` installs it)")
    args = (B, S, H, D, WIDTH, LOOP_N, SCAN_OUTER, SCAN_INNER, M, K)
    proc = aot.run_script(SCRIPT, *map(str, args), timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def _attention(audit: dict, direction: str) -> dict:
    (row,) = [r for r in audit["attention"] if r["direction"] == direction]
    return row


FWD_FULL = 4.0 * B * H * S * S * D   # Q K^T and P V over all S x S scores


def test_dense_mask_cudnn_attention_fails(hlo):
    audit = A.audit_hlo(hlo["dense"], seq_len=S)
    fwd, bwd = _attention(audit, "forward"), _attention(audit, "backward")
    for row in (fwd, bwd):
        assert row["kind"] == "cuDNN fMHA" and row["mask_type"] == "NO_MASK"
        assert row["dense_mask"] and not row["causal"] and "Bias" in row["target"]
    assert fwd["flops"] == FWD_FULL and bwd["flops"] == 2.5 * FWD_FULL
    mask_lines = [f for f in audit["findings"] if f.startswith("cuDNN attention with a dense")]
    assert len(mask_lines) == 2
    for row, line in zip((fwd, bwd), mask_lines):
        assert f"%{row['instructions'][0]} " in line and "is_causal=True" in line
    # the [S, S] mask itself is materialised, and is a finding of its own
    square = [f for f in audit["findings"] if f.startswith("S x S array")]
    assert square and all(f"{S},{S}]" in f for f in square)
    assert len(audit["findings"]) == len(mask_lines) + len(square)


def test_our_mosaic_kernels_count_their_own_matmuls(hlo):
    """The sm90 kernels: a forward (2 units of 2*B*H*S*T*D) and the fused backward (bwd_fused,
    shipped: S, dP, dV, dK and dQ once each, 5 units), causal: what they execute."""
    audit = A.audit_hlo(hlo["mosaic"], seq_len=S)
    unit = 2.0 * B * H * S * S * D / 2
    rows = sorted((r["direction"], r["flops"] / unit) for r in audit["attention"])
    assert rows == [("backward", 5), ("forward", 2)]
    assert {r["kind"] for r in audit["attention"]} == {"Mosaic GPU kernel"}
    assert all(r["causal_assumed"] for r in audit["attention"])
    assert audit["gemms_by_kind"] == {} and audit["findings"] == []


def test_loop_fused_dot_fails(hlo, monkeypatch):
    flops = 2.0 * LOOP_N ** 3
    audit = A.audit_hlo(hlo["loop_dot"], seq_len=7)
    (gemm,) = audit["outside_library"]
    assert gemm["kind"] == "kLoop fusion" and gemm["flops"] == flops
    assert audit["gemms_by_kind"] == {"kLoop fusion": {
        "instructions": 1, "executions": 1, "flops": flops, "largest_flops": flops,
        "library": False}}
    (line,) = audit["findings"]
    assert line.startswith("dot outside a library") and f"%{gemm['name']} " in line
    assert "wrapped_dot" in gemm["name"]
    # the limit is per dot: just above this one's FLOPs, it passes
    monkeypatch.setattr(A, "LOOP_DOT_LIMIT", flops + 1)
    assert A.audit_hlo(hlo["loop_dot"], seq_len=7)["findings"] == []


def test_causal_cudnn_and_library_gemms_pass(hlo):
    gemms = 3 * 2.0 * B * S * WIDTH * WIDTH    # x @ w, and its two gradients
    heads = WIDTH // D
    attention = 3.5 * 4.0 * B * heads * S * S * D / 2    # forward + 2.5x backward, causal half
    audit = A.audit_hlo(hlo["causal_gemm"], seq_len=S, expected=gemms + attention)
    assert audit["findings"] == []
    fwd, bwd = _attention(audit, "forward"), _attention(audit, "backward")
    for row in (fwd, bwd):
        assert row["kind"] == "cuDNN fMHA" and row["mask_type"] == "CAUSAL"
        assert row["causal"] and not row["dense_mask"]
    assert fwd["flops"] == 2.0 * B * heads * S * S * D
    kinds = audit["gemms_by_kind"]
    assert set(kinds) <= {"cuBLAS", "cuBLASLt"} and all(k["library"] for k in kinds.values())
    assert sum(k["flops"] for k in kinds.values()) == gemms
    assert audit["flops"]["compiled"] == gemms + attention and audit["flops"]["ratio"] == 1.0
    assert audit["s_by_s"] == [] and audit["outside_library"] == []
    # the same step against an expectation 20% lower: over the 10% limit
    (line,) = A.audit_hlo(hlo["causal_gemm"], seq_len=S,
                          expected=(gemms + attention) / 1.2)["findings"]
    assert line.startswith("compiled matmul FLOPs") and "20% above" in line


def test_flops_through_nested_scans(hlo):
    per_dot = 2.0 * M * K * K
    audit = A.audit_hlo(hlo["scan"], seq_len=7)
    assert audit["flops"]["compiled"] == SCAN_OUTER * SCAN_INNER * per_dot
    assert sorted((lp["trip_count"], lp["from"]) for lp in audit["loops"]) == [
        (SCAN_INNER, "known_trip_count"), (SCAN_OUTER, "known_trip_count")]
    (gemm,) = audit["largest_gemms"]
    assert gemm["flops"] == per_dot and gemm["count"] == SCAN_OUTER * SCAN_INNER
    # without XLA's annotation the trip count comes from the constant the condition tests
    bare = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", hlo["scan"])
    again = A.audit_hlo(bare, seq_len=7)
    assert again["flops"]["compiled"] == audit["flops"]["compiled"]
    assert {lp["from"] for lp in again["loops"]} == {"condition constant"}


def test_format_audit_lists_the_tables_and_findings(hlo):
    audit = A.audit_hlo(hlo["dense"], seq_len=S)
    text = A.format_audit(audit)
    for needle in ("attention calls", "cuDNN fMHA", "NO_MASK", "S x S arrays (S=256): ",
                   "largest buffers", "collectives by dtype", f"findings: {len(audit['findings'])}"):
        assert needle in text
    assert all(f"    - {f}" in text for f in audit["findings"])
    assert A.format_audit({"skipped": "why"}) == "audit: not done: why"


def test_expected_flops_follow_the_documented_formula():
    from titanax.config import load_config
    from titanax.models.registry import model_spec

    def expected(*sets):
        cfg = load_config(aot.REPO / "configs/tiny.py",
                          ["train.seq_len=128", "train.batch_size=4", *sets])
        return cfg, A.expected_flops(cfg, n_devices=2)

    cfg, none = expected("execution.remat=none")
    m, s = cfg.model, 128
    q, kv = m.n_heads * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim
    per_layer = m.d_model * (2 * q + 2 * kv + 3 * m.ffn_dim + 2)   # q, o, k, v, mlp, norms
    output = m.vocab_size * m.d_model
    n = m.n_layers * per_layer + m.d_model + output                # + final norm, output
    assert model_spec(m).count_params(m, exclude_embedding=True) == n
    a = 2.0 * m.n_layers * q * s                    # attention forward, causal half
    assert none["per_token"] == 6 * n + 3.5 * a
    assert none["formula_per_token"] == 6 * n + 12 * m.n_layers * q * s
    assert none["per_device"] == none["per_token"] * 4 * s / 2
    layers = n - output                             # what remat recomputes: all but the output
    assert expected("execution.remat=full")[1]["per_token"] == 6 * n + 3.5 * a + 2 * layers + a
    assert expected("execution.remat=full_offload")[1]["per_token"] == 6 * n + 4.5 * a + 2 * layers
    assert expected("execution.remat=dots")[1]["per_token"] == 6 * n + 4.5 * a
    # gpipe over 2 stages, 4 microbatches: the layers run 4 + 1 ticks for 4 microbatches' work
    _, piped = expected("execution.remat=none", "mesh.pipeline=2", "pipeline.microbatches=4")
    assert piped["per_token"] == pytest.approx(6 * output + (6 * layers + 3.5 * a) * 5 / 4)


def test_plan_json_and_launch_plan_carry_the_audit(hlo, monkeypatch, tmp_path, capsys):
    """The audit the compile subprocess returns becomes plan.json's "audit" (not a part of
    "compile"); launch.plan --audit prints its table and exits 1, one line per finding."""
    from launch import plan as launch_plan
    from titanax.plan import compile as plan_compile

    dense = A.audit_hlo(hlo["dense"], seq_len=S)
    asked, returns = [], {"audit": dense}

    def fake_compile(cfg, cluster, audit=False, **kw):
        asked.append(audit)
        memory = dict(arguments=1e9, temporaries=1e9, outputs=0, aliased=0, total=2e9)
        return {"ok": True, "target": "gpu", "device_kind": "NVIDIA H100", "memory": memory,
                "lower_s": 1.0, "compile_s": 1.0, **returns}

    monkeypatch.setattr(plan_compile, "compile_in_subprocess", fake_compile)
    argv = ["--config", str(aot.REPO / "configs/llama3_8b.py"), "--gpu", "h100", "--nodes", "1",
            "--set", "model.n_layers=2", "--audit", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        launch_plan.main(argv)
    assert exit_.value.code == 1 and asked == [True]
    out, err = capsys.readouterr()
    assert A.format_audit(dense) in out
    assert err.splitlines()[-len(dense["findings"]):] == [f"AUDIT: {f}" for f in dense["findings"]]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["audit"]["findings"] == dense["findings"] and "audit" not in plan["compile"]
    # a clean audit exits 0; no audit (simulated CPU devices) is an error, not a pass
    returns["audit"] = {**dense, "findings": []}
    launch_plan.main(argv)
    returns["audit"] = plan_compile._audit(None, "", "cpu", 8)
    with pytest.raises(SystemExit) as exit_:
        launch_plan.main(argv)
    assert exit_.value.code != 0 and "audit: not done" in capsys.readouterr().err


def test_s_by_s_when_seq_len_is_also_a_weight_dimension():
    """Llama-3-70B at 8192 tokens: d_model is 8192 too, so [d, d] weights and [B, S, d]
    activations have two dims equal to S; then only attention code's arrays count."""
    square = A.SquareTest(8192, weight_dims={8192, 1024, 28672})
    assert square((4, 64, 8192, 8192), "flash_attention/mask.py:52 (Mask.dense)")
    assert not square((8192, 8192), "ops/linear.py:142 (_dot)")
    assert square.ambiguous((2, 4, 8192, 8192), "models/decoder.py:188 (Decoder._run_layers)")
    assert not square((4, 8192, 1024), "flash_attention/mask.py:52 (Mask.dense)")
    plain = A.SquareTest(6144, weight_dims={8192, 1024, 28672})
    assert plain((2, 4, 6144, 6144), "models/decoder.py:188 (Decoder._run_layers)")
    assert not plain.ambiguous((6144, 6144))
