"""The first check of a GPU loan's preflight (preflight.py, `launch.gpu_check --preflight`):
imports everything the sections need, in dependency order, and prints each version, so a loan on
a machine that lacks a package ends in one line naming it (and what to carry: docs/gpu_check.md)
instead of a traceback minutes in. Imports only: no device is touched and nothing compiles.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys

# (import name, pip name): third-party packages the sections import, then ours.
THIRD_PARTY = (("numpy", "numpy"), ("jax", "jax"), ("jaxlib", "jaxlib"), ("flax", "flax"),
               ("optax", "optax"), ("orbax.checkpoint", "orbax-checkpoint"),
               ("tokenizers", "tokenizers"), ("safetensors", "safetensors"))
OURS = ("titanax", "pallas_kernels", "launch.gpu_check", "titanax.perf.gpu_check.device",
        "titanax.perf.gpu_check.kernels", "titanax.perf.gpu_check.throughput",
        "titanax.perf.gpu_check.train_step")
CARRY = ("carry its wheel in the working tree: docs/gpu_check.md, 'What to carry'")


def _version(module) -> str:
    return str(getattr(module, "__version__", None) or getattr(module, "version", "?"))


def check(out=sys.stdout) -> str | None:
    """Prints one line per package; returns the error line, or None when all import."""
    print(f"python {platform.python_version()} ({sys.executable})", file=out)
    for name, pip_name in THIRD_PARTY:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure to import is the one line
            return f"cannot import {name} ({type(e).__name__}: {e}): {CARRY} ({pip_name})"
        print(f"{name} {_version(module)}", file=out)
    try:
        import jax

        plugins = sorted(p.metadata["Name"] for p in importlib.metadata.distributions()
                         if p.metadata["Name"] and "jax-cuda" in p.metadata["Name"].lower())
        print(f"jax plugins: {', '.join(plugins) or 'none'}; JAX_PLATFORMS="
              f"{jax.config.jax_platforms or '(all)'}", file=out)
    except Exception as e:  # noqa: BLE001 - informational
        print(f"jax plugins: unknown ({type(e).__name__})", file=out)
    for name in OURS:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in ("titanax", "pallas_kernels", "launch"):
                return (f"cannot import {name}: {e}; run from the repository root with src/ on "
                        "PYTHONPATH (scripts/gpu_loan.sh does both)")
            return f"cannot import {e.name} (needed by {name}): {CARRY} ({e.name})"
        except Exception as e:  # noqa: BLE001
            return f"importing {name} failed: {type(e).__name__}: {str(e)[:300]}"
    print(f"titanax and its GPU check import from {sys.modules['titanax'].__file__}", file=out)
    return None
