"""The launchers preload TCMalloc (launch/common.py use_tcmalloc): XLA:CPU page-faults its
temporaries in again at every step under glibc's malloc. The PyTorch peer of launch.bench runs
in the user's own environment, without titanax's preload."""

import os
import subprocess
import sys

import pytest

from launch.common import find_tcmalloc
from titanax.perf.train_sweeps import allocator, peer_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROBE = ("from launch.common import use_tcmalloc; use_tcmalloc(); import os; "
          "print(os.environ.get('LD_PRELOAD', ''), os.environ.get('TITANAX_PRELOADED', ''))")


def _probe(**env):
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TITANAX_PRELOADED")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=full,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split("\n")[0]


@pytest.mark.skipif(find_tcmalloc() is None, reason="TCMalloc is not installed "
                    "(scripts/dev.sh installs Debian's libtcmalloc-minimal4 as root)")
def test_launcher_reexecs_with_tcmalloc_once():
    preload, ours = _probe().split(" ")
    assert "tcmalloc" in preload and ours == find_tcmalloc()
    assert allocator({"LD_PRELOAD": preload}) == "tcmalloc"
    # opted out: the process keeps glibc's malloc
    assert _probe(TITANAX_MALLOC="system").strip() == ""


def test_peer_runs_without_our_preload_but_with_the_users():
    ours = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    env = peer_env({"LD_PRELOAD": f"{ours}:/opt/user.so", "TITANAX_PRELOADED": ours, "A": "1"})
    assert env == {"LD_PRELOAD": "/opt/user.so", "A": "1"}
    env = peer_env({"LD_PRELOAD": ours, "TITANAX_PRELOADED": ours})
    assert "LD_PRELOAD" not in env and allocator(env) == "glibc malloc"
    # the user preloaded it themselves: both systems run on it
    env = peer_env({"LD_PRELOAD": ours})
    assert env["LD_PRELOAD"] == ours and allocator(env) == "tcmalloc"
