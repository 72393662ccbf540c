"""Which sm90 attention kernel hangs, and on what: each case (one kernel of kernel_sm90*.py, its
shape, one document or three packed ones) in its own process with a timeout, one line each.

On a GPU loan (the first one's third call, docs/performance.md):
    PYTHONPATH=src:. JAX_PLATFORMS=cuda DIAG_TIMEOUT=20 python3 scripts/sm90_hang_probe.py
On a CPU the same kernels in the Mosaic GPU interpreter (which passed all of them: it models no
register pool): DIAG_INTERPRET=1 JAX_PLATFORMS=cpu PJRT_NPROC=16 ... scripts/sm90_hang_probe.py CASE
The inputs are random (values do not matter for a hang): lse2 8, delta 0."""
import json
import os
import subprocess
import sys
import time

CASES = [
    # name, kernel, B, S, H, N, docs ("packed" | "one"), config knobs
    ("fwd_b2_h16", "fwd", 2, 1000, 16, 2, "packed", {}),
    ("dq_b2_h16", "dq", 2, 1000, 16, 2, "packed", {}),
    ("dkv_b2_h16", "dkv", 2, 1000, 16, 2, "packed", {}),
    ("fwd_b1_h2", "fwd", 1, 1000, 2, 1, "packed", {}),
    ("dq_b1_h2", "dq", 1, 1000, 2, 1, "packed", {}),
    ("dkv_b1_h2", "dkv", 1, 1000, 2, 1, "packed", {}),
    ("fwd_b2_h16_onedoc", "fwd", 2, 1000, 16, 2, "one", {}),
    ("dkv_b2_h16_onedoc", "dkv", 2, 1000, 16, 2, "one", {}),
    ("fused_b2_h16", "fused", 2, 1000, 16, 2, "packed", {"bwd_fused": True}),
    ("fwd_b2_h16_s1024", "fwd", 2, 1024, 16, 2, "packed", {}),
]


def child(name):
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.flash_attention import kernel_sm90, kernel_sm90_bwd
    from pallas_kernels.flash_attention.check import packed_segments
    from pallas_kernels.flash_attention.config import default_config
    from pallas_kernels.flash_attention.kernel_sm90_bwd_fused import fused_bwd
    _, kern, B, S, H, N, docs, knobs = next(c for c in CASES if c[0] == name)
    D = 128
    cfg = dataclasses.replace(default_config("mosaic_sm90", D), **knobs)
    Sp = -(-S // 128) * 128
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
    q, k, v, do, o = r(B, Sp, H, D), r(B, Sp, N, D), r(B, Sp, N, D), r(B, Sp, H, D), r(B, Sp, H, D)
    seg = packed_segments(B, Sp) if docs == "packed" else jnp.zeros((B, Sp), jnp.int32)
    lse2 = jnp.full((B, H, Sp), 8.0, jnp.float32)
    interp = os.environ.get("DIAG_INTERPRET") == "1"
    kw = dict(scale=D ** -0.5, causal=True, kv_len=S, config=cfg, interpret=interp)
    if kern == "fwd":
        f = jax.jit(lambda q, k, v, s: kernel_sm90.flash_fwd(q, k, v, s, s, **kw))
        args = (q, k, v, seg)
    elif kern in ("dq", "dkv"):
        fn = kernel_sm90_bwd._dq if kern == "dq" else kernel_sm90_bwd._dkv
        f = jax.jit(lambda q, k, v, do, l, d, s: fn(q, k, v, do, l, d, s, s, **kw))
        args = (q, k, v, do, lse2, jnp.zeros((B, H, Sp), jnp.float32), seg)
    else:
        f = jax.jit(lambda q, k, v, o, l, do, s: fused_bwd(q, k, v, o, l, do, s, s, **kw))
        args = (q, k, v, o, lse2, do, seg)
    t0 = time.time()
    jax.block_until_ready(f(*args))  # compile and first run
    t1 = time.time()
    jax.block_until_ready(f(*args))
    print(json.dumps({"first_call_s": round(t1 - t0, 2), "second_call_s": round(time.time() - t1, 4)}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
        sys.exit(0)
    timeout = float(os.environ.get("DIAG_TIMEOUT", "25"))
    for c in CASES:
        t = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, c[0]], capture_output=True, text=True,
                               timeout=timeout, env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
            res = ("ok " + p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else (
                f"rc={p.returncode} " + " / ".join(p.stderr.strip().splitlines()[-3:])[-600:])
        except subprocess.TimeoutExpired:
            res = f"HANG (no result in {timeout:.0f} s)"
        print(f"{c[0]}: {res} [{time.time() - t:.1f} s]", flush=True)
