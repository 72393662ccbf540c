"""Flags shared by the launch scripts (argument parsing lives in launch/ only)."""

from __future__ import annotations

import argparse
import sys


def add_config_flags(p: argparse.ArgumentParser, *, default_config: str | None) -> None:
    p.add_argument("--config", default=default_config,
                   help="configs/NAME.py (defining config()) or configs/NAME.gin")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE", help="override one config field (repeatable)")


def add_host_devices_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-devices", type=int, default=0,
                   help="simulate N CPU devices (testing meshes without GPUs)")


def setup_jax(host_devices: int) -> None:
    """Must run before jax touches a backend."""
    import jax

    if host_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", host_devices)


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)
