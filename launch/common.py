"""Flags shared by the launch scripts (argument parsing lives in launch/ only)."""

from __future__ import annotations

import argparse
import ctypes.util
import os
import sys

# Where Debian/Ubuntu (libtcmalloc-minimal4, installed by scripts/dev.sh) and RHEL put it.
_TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                   "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                   "/usr/lib64/libtcmalloc_minimal.so.4")


def find_tcmalloc() -> str | None:
    for path in _TCMALLOC_PATHS:
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def use_tcmalloc() -> None:
    """Re-executes this command with TCMalloc preloaded, as JAX recommends for CPU hosts.
    XLA:CPU allocates a step's temporaries anew at every step; glibc hands large blocks back to
    the kernel and every step page-faults them in again (the CPU benchmark's step runs 16%
    faster with TCMalloc, docs/performance.md). Call it first thing in a launcher's
    `__main__` (never in code that tests import). A no-op when TCMalloc is loaded already or
    not installed, or with TITANAX_MALLOC=system."""
    if os.environ.get("TITANAX_MALLOC", "tcmalloc") == "system":
        return
    if "tcmalloc" in os.environ.get("LD_PRELOAD", "") or os.environ.get("TITANAX_PRELOADED"):
        return
    lib = find_tcmalloc()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    # Marks what titanax added: child processes that are not titanax (the PyTorch peer of
    # launch.bench) get the environment back as the user had it.
    env["TITANAX_PRELOADED"] = lib
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def add_config_flags(p: argparse.ArgumentParser, *, default_config: str | None) -> None:
    p.add_argument("--config", default=default_config,
                   help="configs/NAME.py (defining config()), configs/NAME.gin, or "
                   "a run's WORKDIR/config.json")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE", help="override one config field (repeatable)")


def _device_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of devices, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of devices, got {n} "
                                         "(leave the flag out for the real devices)")
    return n


def add_host_devices_flag(p: argparse.ArgumentParser) -> None:
    # None: not given (the real devices); a value given must be positive.
    p.add_argument("--host-devices", type=_device_count, default=None, metavar="N",
                   help="simulate N CPU devices (testing meshes without GPUs)")


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process (detected from SLURM or TITANAX_*/JAX_* env vars "
                             "when not given)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service")
    g.add_argument("--num-processes", type=int, default=None, metavar="N")
    g.add_argument("--process-id", type=int, default=None, metavar="I")
    g.add_argument("--heartbeat-timeout", type=int, default=60, metavar="SECONDS",
                   help="a process silent this long counts as dead and stops the others")


def setup_jax(host_devices: int | None, args: argparse.Namespace | None = None) -> None:
    """Must run before jax is imported: simulated CPU devices, then (when the run is
    multi-process: `args`' distributed flags, the env or SLURM) a process guard and
    jax.distributed."""
    spec = None
    if args is not None and hasattr(args, "coordinator"):
        from titanax import distributed

        try:
            spec = distributed.resolve_processes(args.coordinator, args.num_processes,
                                                 args.process_id)
        except distributed.DistributedError as e:
            fail(str(e))
    if spec is not None:
        from titanax.process_guard import guard

        # forks; the child returns and trains
        guard(spec.process_id, spec.num_processes, hold_s=args.heartbeat_timeout + 30)
    import jax

    if host_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", host_devices)
    if spec is not None:
        print(f"titanax: starting {spec.describe()}", file=sys.stderr, flush=True)
        distributed.initialize(spec, heartbeat_timeout_s=args.heartbeat_timeout)


# Exit codes of every launcher: bad input the user can fix in the command or config is 2 (as
# argparse uses); a run that cannot go on (damaged checkpoints, divergence) is 1.
EXIT_CONFIG, EXIT_FAILED = 2, 1


def fail(msg: str, code: int = EXIT_CONFIG) -> None:
    """Ends the command with `error: msg` on stderr, no traceback."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def stop(msg: str) -> None:
    """fail() for a run that cannot go on (exit 1), not a configuration error."""
    fail(msg, EXIT_FAILED)
