"""Compiles the real train step for a cluster that is not here, and reads its memory.

The step is the one train/loop.py runs (abstract_train_state + jit_train_step, batch sharded
as the data pipeline delivers it), lowered with ShapeDtypeStructs, so nothing is allocated.
Targets, best first:
- 'gpu': compile-only CUDA devices of the GPU kind (pallas_kernels.aot: the CUDA PJRT plugin
  with a GpuTargetConfigProto per kind), laid out as the cluster's hosts, so build_mesh cuts
  the same NVLink domains as on the real machines and XLA's GPU compiler decides fusion,
  rematerialisation and buffer assignment for that chip's memory, under the XLA flags a GPU
  run of launch.train gets (titanax.xla_flags: collective overlap moves the memory peak);
- 'cpu': simulated CPU devices (jax_num_cpu_devices) when the plugin is not installed; the
  sharding and the program are the same, the memory figures are XLA:CPU's (attention falls
  back to XLA's, which materialises S x S scores), so the planner then trusts its model.
Runs in a subprocess (`compile_in_subprocess`, or `compile_all_in_subprocess` for several
configs) so the caller never loads CUDA or changes its own device count: `python -m
titanax.plan.compile SPEC.json` prints one RESULT line per config.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from pallas_kernels import aot
from titanax import xla_flags
from titanax.config import Config
from titanax.perf.hlo_text import collective_dtypes
from titanax.plan.cluster import Cluster

_RESULT = "PLAN_COMPILE_RESULT "


def compile_train_step(cfg: Config, cluster: Cluster, target: str, buffers: int = 0,
                       audit: bool = False) -> dict:
    """In this process (already set up for `target`): lower and compile; memory per device.
    buffers > 0: also the largest buffers live at the memory peak (titanax.plan.buffers).
    audit: also the audit of the optimized HLO (titanax.plan.audit), GPU target only."""
    import jax

    from titanax.parallel.mesh import build_mesh, describe_mesh
    from titanax.parallel.rules import model_context
    from titanax.train.memory_fit import compiled_memory, lower_train_step

    t0 = time.perf_counter()
    if target == "gpu":
        devices = aot.gpu_topology(cluster.gpu, cluster.topology).devices
    else:
        devices = jax.devices()[:cluster.n_gpus]
    mesh = build_mesh(cfg.mesh, devices)
    # (lowering includes building the abstract state, which must happen outside the mesh
    # context: train.offload_* find the optimizer moments with an eager tx.init on no device)
    t1 = time.perf_counter()
    lowered = lower_train_step(cfg, mesh)
    t2 = time.perf_counter()
    with model_context(mesh):
        options = xla_flags.compiler_options(cfg)  # loop_double_buffering=false
        if buffers:     # XLA dumps its buffer assignment into a temporary folder
            from titanax.plan.buffers import compile_with_buffers
            compiled, peak_buffers = compile_with_buffers(lowered, top=buffers, options=options)
        else:
            compiled = lowered.compile(compiler_options=options or None)
        t3 = time.perf_counter()
    hlo = compiled.as_text()
    return {
        "target": target,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "processes": len({d.process_index for d in devices}),
        "mesh": describe_mesh(mesh),
        "setup_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
        "memory": compiled_memory(compiled),
        "collectives": collective_dtypes(hlo),
        **({"peak_buffers": peak_buffers} if buffers else {}),
        **({"audit": _audit(cfg, hlo, target, len(devices))} if audit else {}),
    }


def _audit(cfg: Config, hlo: str, target: str, n_devices: int) -> dict:
    if target != "gpu":
        return {"skipped": "no deviceless CUDA compile (the CUDA plugin is not installed; "
                           "`bash scripts/dev.sh cuda-plugin` installs it): XLA:CPU's program is not the GPU's"}
    from titanax.plan.audit import audit_step
    return audit_step(cfg, hlo, n_devices)


def _worker_env(cluster: Cluster) -> tuple[dict, str]:
    return worker_env(cluster.n_gpus)


def worker_env(n_gpus: int) -> tuple[dict, str]:
    """(environment, target) of a compile subprocess: deviceless CUDA with the GPU flags when
    the plugin is installed ('gpu'), else n_gpus simulated CPU devices ('cpu')."""
    if aot.plugin_available():
        # The XLA flags launch.train runs with on GPU: they move the compiled memory peak.
        env = aot.cuda_plugin_env()
        env["XLA_FLAGS"] = xla_flags.with_gpu_flags(env.get("XLA_FLAGS", ""), env)
        return env, "gpu"
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUM_CPU_DEVICES"] = str(n_gpus)
    return env, "cpu"


def _error_summary(stderr: str) -> str:
    """The exception lines of a failed compile (not the XLA stack frames around them)."""
    lines = [l.strip() for l in stderr.splitlines()]
    errors = [l for l in lines if re.match(r"^[\w.]*(Error|Exception)\b", l)]
    return " | ".join(dict.fromkeys(errors))[-1500:] if errors else "\n".join(lines[-5:])


def compile_in_subprocess(cfg: Config, cluster: Cluster, *, timeout_s: float = 600,
                          buffers: int = 0, fit: dict | None = None, audit: bool = False) -> dict:
    """compile_train_step in a fresh process: {'ok': True, ...} or {'ok': False, 'error'}.
    fit {'capacity': bytes, 'where': text}: on the GPU target, when the step exceeds the
    capacity, also the smallest grad_accum / remat change that fits ('fit': plan.fit's
    answer; each candidate is one more compile, so the time limit grows with them).
    audit: the result's 'audit' (titanax.plan.audit), read in the subprocess from the
    optimized HLO (tens of MB for a 70B step, never sent back)."""
    env, target = _worker_env(cluster)
    spec = {"config": cfg.to_dict(), "gpu": cluster.gpu, "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node, "target": target, "buffers": buffers,
            "fit": fit if target == "gpu" else None, "audit": audit}
    if spec["fit"]:
        timeout_s *= 8
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "titanax.plan.compile", json.dumps(spec)],
                              env=env, capture_output=True, text=True, timeout=timeout_s,
                              cwd=aot.REPO)
    except subprocess.TimeoutExpired:
        return {"ok": False, "target": target,
                "error": f"compile did not finish within {timeout_s:.0f} s"}
    lines = [l for l in proc.stdout.splitlines() if l.startswith(_RESULT)]
    if proc.returncode or not lines:
        return {"ok": False, "target": target, "error": _error_summary(proc.stderr)
                or f"exit {proc.returncode}"}
    result = json.loads(lines[-1][len(_RESULT):])
    result.update(ok=True, wall_s=time.perf_counter() - t0)
    return result


def compile_all_in_subprocess(cfgs: list[Config], cluster: Cluster, *,
                              timeout_s: float = 600) -> list[dict]:
    """compile_train_step of each config, in one fresh process (its start, CUDA's plugin and
    the imports are paid once): compile_in_subprocess's result per config, in order. A
    config that does not compile gets {'ok': False, 'error'} and the others still run."""
    env, target = _worker_env(cluster)
    spec = {"configs": [c.to_dict() for c in cfgs], "gpu": cluster.gpu, "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node, "target": target}
    try:
        proc = subprocess.run([sys.executable, "-m", "titanax.plan.compile", json.dumps(spec)],
                              env=env, capture_output=True, text=True,
                              timeout=timeout_s * len(cfgs), cwd=aot.REPO)
    except subprocess.TimeoutExpired:
        return [{"ok": False, "target": target, "error": "compiles did not finish within "
                 f"{timeout_s * len(cfgs):.0f} s"}] * len(cfgs)
    results = [json.loads(l[len(_RESULT):]) for l in proc.stdout.splitlines()
               if l.startswith(_RESULT)]
    if len(results) != len(cfgs):
        error = _error_summary(proc.stderr) or f"exit {proc.returncode}"
        return [{"ok": False, "target": target, "error": error}] * len(cfgs)
    return [r if "error" in r else {**r, "ok": True} for r in results]


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    if spec["target"] == "cpu":
        import jax
        jax.config.update("jax_num_cpu_devices",
                          spec["nodes"] * spec["gpus_per_node"])
    cluster = Cluster(spec["gpu"], spec["nodes"], spec["gpus_per_node"])
    if "configs" in spec:  # compile_all_in_subprocess: one RESULT line per config
        for c in spec["configs"]:
            try:
                result = compile_train_step(Config.from_dict(c), cluster, spec["target"])
            except Exception as e:  # noqa: BLE001 - reported, the next config still runs
                result = {"ok": False, "target": spec["target"],
                          "error": f"{type(e).__name__}: {str(e)[:1500]}"}
            print(_RESULT + json.dumps(result), flush=True)
        return
    cfg = Config.from_dict(spec["config"])
    audit = spec.get("audit", False)
    result = compile_train_step(cfg, cluster, spec["target"], spec.get("buffers", 0), audit)
    if spec.get("fit"):
        result["fit"] = _fit(cfg, cluster, spec["target"], spec["fit"], result["memory"], audit)
    print(_RESULT + json.dumps(result), flush=True)


def _fit(cfg: Config, cluster: Cluster, target: str, fit: dict, need: dict,
         audit: bool = False) -> dict:
    """plan.fit's answer for cfg on the cluster, candidates compiled here, one by one."""
    from titanax.config.parallel import batch_ways
    from titanax.plan.cluster import layout_for
    from titanax.plan.fit import search_fit

    degrees = layout_for(cfg, cluster).degrees
    answer = search_fit(cfg, lambda c: compile_train_step(c, cluster, target, audit=audit),
                        fit["capacity"], fit["where"], batch_ways(degrees), need=need,
                        log=lambda msg: print(msg, file=sys.stderr, flush=True),
                        predict=lambda c: predicted_step_s(c, cluster),
                        loop_buffering=target == "gpu")
    return {"line": answer.line(), "fits": answer.fits, "overrides": answer.overrides,
            "bytes": answer.fit_bytes, "tried": answer.tried, "set_flags": answer.set_flags(),
            "why": answer.why, "result": answer.fit_result}


def predicted_step_s(cfg: Config, cluster: Cluster) -> float:
    """The cost model's step time of cfg on the cluster (plan.fit's tie-breaker)."""
    from titanax.plan.cluster import layout_for
    from titanax.plan.cost_model import estimate

    return estimate(cfg, cluster, layout_for(cfg, cluster)).step_s


if __name__ == "__main__":
    main(sys.argv[1:])
