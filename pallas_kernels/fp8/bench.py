"""TFLOP/s of the FP8 matmul implementations against XLA's own FP8 dot and the bf16 matmul at
the Llama-70B GEMM shapes: tokens x (8192 -> 8192), (8192 -> 28672), (28672 -> 8192).
`python -m launch.bench fp8` and titanax's gpu_check time through run(), so both report the
same numbers.

FLOPs per GEMM = 2 * M * N * K (M tokens, K in, N out); TFLOP/s = that / median time.
Operands are quantized once before timing: the numbers are the GEMM alone (the quantizers are
elementwise passes XLA fuses into the producers).

Cases: bf16 (jnp.dot, bf16 in, f32 accumulate, bf16 out), xla_fp8 (tensorwise e4m3 dot
through XLA: cuBLASLt on Hopper), xla_rowwise (the same dot, its float32 result times the
row and column scales), xla_mx (jax.nn.scaled_matmul, MXFP8: cuDNN on Blackwell), and every
kernel of backends.py's MATMULS table by its name in its first scaling mode (sm90:
tensorwise, sm100: MX, pallas_grid: the portable grid kernel, interpreted on CPU so only with
a large `scale`) and as name_mode in its others (sm90_rowwise). case_kernel() maps a case
name to (implementation, scaling mode).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from ..target import compute_capability
from ..timing import median_call_seconds
from .api import fp8_matmul
from .backends import MATMULS, generation_kernels
from .quant import quantize_mxfp8, quantize_rowwise, quantize_tensorwise

SHAPES = [(8192, 8192), (8192, 28672), (28672, 8192)]  # (K in, N out) of Llama-3-70B's GEMMs
# case name -> (fp8_matmul impl, scaling mode); bf16 is jnp.dot.
_XLA = {"xla_fp8": ("xla", "tensorwise"), "xla_rowwise": ("xla", "rowwise"),
        "xla_mx": ("xla", "mx")}
BASELINES = ("bf16", *_XLA)
KERNEL_CASES = {(n if i == 0 else f"{n}_{s}"): (n, s)
                for n, m in MATMULS.items() if m.run.startswith(".matmul_")
                for i, s in enumerate(m.scalings)}
CASES = BASELINES + tuple(KERNEL_CASES)


def case_kernel(name: str) -> tuple[str | None, str | None]:
    """(fp8_matmul impl, scaling mode) a case times: ('xla', 'rowwise') for xla_rowwise,
    ('sm90', 'tensorwise') for sm90; (None, None) for bf16."""
    if name == "bf16":
        return None, None
    if name not in _XLA and name not in KERNEL_CASES:
        raise ValueError(f"unknown fp8 bench case {name!r}; use one of {list(CASES)}")
    return _XLA.get(name) or KERNEL_CASES[name]


def default_impls() -> list[str]:
    """What the platform runs: bf16 and XLA's FP8 dot, plus XLA's MX matmul and our kernels
    for this GPU generation (Hopper has no MX hardware: no xla_mx there)."""
    cc = compute_capability()
    if cc is None:
        return ["bf16", "xla_fp8", "xla_rowwise"]
    ours = [c for c, (n, s) in KERNEL_CASES.items()
            if n in {m.name for m in generation_kernels(cc[0], s)}]
    return ["bf16", "xla_fp8", "xla_rowwise"] + (["xla_mx"] if cc[0] >= 10 else []) + ours


def _operands(m: int, k: int, n: int) -> dict:
    """The shape's operands, bf16 and quantized both ways, by scaling mode."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = (jax.random.normal(kb, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    qa, sa = jax.jit(quantize_tensorwise)(a)
    qb, sb = jax.jit(quantize_tensorwise)(b)
    ra, rsa = jax.jit(lambda x: quantize_rowwise(x, axis=1))(a)
    rb, rsb = jax.jit(lambda x: quantize_rowwise(x, axis=0))(b)
    ma, msa = jax.jit(lambda x: quantize_mxfp8(x, axis=1))(a)
    mb, msb = jax.jit(lambda x: quantize_mxfp8(x, axis=0))(b)
    return {"bf16": (a, b), "tensorwise": (qa, sa, qb, sb), "rowwise": (ra, rsa, rb, rsb),
            "mx": (ma, msa, mb, msb)}


def _case(name: str, ops: dict, on_cpu: bool):
    """(jitted function, its arguments) of one case."""
    if name == "bf16":
        return (jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)
                        .astype(jnp.bfloat16)), ops["bf16"])
    impl, mode = case_kernel(name)
    kw = {"interpret": on_cpu} if MATMULS[impl].interpret == "grid" else {}
    return jax.jit(lambda *t: fp8_matmul(*t, impl=impl, **kw)), ops[mode]


def run(tokens: int = 8192, scale: int = 1, impls=None, iters: int = 20, on_row=None) -> dict:
    """{'device', 'platform', ..., 'rows'}: one row per (shape, impl) with ms, tflops and
    vs_bf16, or the error of an impl that failed (reported on stderr; the others go on).
    on_row(row) is called as each row is measured (gpu_check saves it at once)."""
    on_row = on_row or (lambda row: None)
    impls = list(impls or default_impls())
    dev = jax.devices()[0]
    rows = []
    for k, n in SHAPES:
        m, k, n = tokens // scale, k // scale, n // scale
        ops = _operands(m, k, n)
        flops = 2.0 * m * n * k
        base = None
        for impl in impls:
            fn, fargs = _case(impl, ops, dev.platform == "cpu")
            try:
                sec = median_call_seconds(fn, fargs, iters)
            except Exception as e:  # noqa: BLE001 - report and go on: one table, one run
                print(f"  {impl} at {m}x{k}->{n} failed: {type(e).__name__}: {str(e)[:200]}",
                      file=sys.stderr)
                rows.append({"m": m, "k": k, "n": n, "impl": impl, "error": str(e)[:500]})
                on_row(rows[-1])
                continue
            tflops = flops / sec / 1e12
            base = tflops if impl == "bf16" else base
            rows.append({"m": m, "k": k, "n": n, "impl": impl, "ms": sec * 1e3,
                         "tflops": tflops, "vs_bf16": tflops / base if base else None})
            on_row(rows[-1])
    return {"device": dev.device_kind, "platform": dev.platform, "tokens": tokens,
            "scale": scale, "iters": iters, "flops": "2*M*N*K", "impls": impls, "rows": rows}
