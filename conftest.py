"""Test set-up for tests/ and pallas_kernels/.

Tests run on the CPU (JAX_PLATFORMS=cpu), even on a machine with a GPU. Two more settings must
be made before jax creates its CPU client, so they cannot be fixtures; they are made here once
pytest has collected every test (it collects all before running any), and only when a
collected test needs them:

- 8 simulated CPU devices (jax_num_cpu_devices) when a test takes the `devices8` fixture (the
  mesh tests: `pytestmark = pytest.mark.usefixtures("devices8")`); the fixture asserts it got
  them. A run of tests that need no mesh keeps jax's default of one device.
- A wider XLA CPU thread pool (PJRT_NPROC=16) when a test is marked `mosaic_interpret`: the
  Mosaic GPU interpreter runs each warpgroup of a kernel as its own XLA CPU computation, and a
  warpgroup waiting on an mbarrier blocks a pool thread inside a host callback. XLA sizes the
  pool by the core count (2 on CI), so two waiting warpgroups could starve the third, the one
  they wait for, and the kernel hung.
"""

import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU without LLVM's optimisations: the suite compiles hundreds of small programs, LLVM
# is most of each compile, and at test shapes its faster code saves nothing (two layouts of
# tests/test_parallel.py: 38 s -> 16 s). Inherited by the suite's subprocesses; deviceless
# GPU compiles drop it (pallas_kernels.aot.cuda_plugin_env: register counts are the product's).
# TITANAX_TEST_XLA_OPT=1 keeps XLA's default.
CPU_TEST_XLA_FLAG = "--xla_backend_optimization_level=0"
if os.environ.get("TITANAX_TEST_XLA_OPT") != "1" and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{CPU_TEST_XLA_FLAG} {os.environ.get('XLA_FLAGS', '')}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

SIMULATED_DEVICES = 8
MOSAIC_POOL_THREADS = "16"


def pytest_configure(config):
    config.addinivalue_line("markers", "mosaic_interpret: runs kernels in the Mosaic GPU "
                            "interpreter (needs a wider XLA CPU thread pool)")


# Seconds each test file took in a full run on a 2-core machine (tests/durations.json, written
# by scripts/test_durations.py from pytest's --durations=0 report). The suite runs on two
# workers, a file at a time each (scripts/dev.sh: --dist loadfile --no-loadscope-reorder), and
# a worker takes the next file in collection order when it runs dry: the longest files go
# first, so the run does not end on one worker's long file while the other idles.
DURATIONS = pathlib.Path(__file__).parent / "tests" / "durations.json"


def _longest_files_first(items) -> None:
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    # A file the table does not know yet (a new one) counts as an average one.
    default = sum(seconds.values()) / max(len(seconds), 1)
    file_of = lambda item: item.nodeid.split("::", 1)[0]
    order = {f: i for i, f in enumerate(dict.fromkeys(file_of(item) for item in items))}
    items.sort(key=lambda item: (-seconds.get(file_of(item), default), order[file_of(item)]))


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
    need_devices = any("devices8" in item.fixturenames for item in items)
    need_pool = any(item.get_closest_marker("mosaic_interpret") for item in items)
    if (need_devices or need_pool) and xla_bridge.backends_are_initialized():
        raise pytest.UsageError(
            "jax's CPU client was created while the tests were collected (a test module ran "
            "jax at import time), so conftest.py can no longer set the simulated device count "
            "or the thread pool; move that jax call into a test or a fixture")
    if need_pool:
        os.environ.setdefault("PJRT_NPROC", MOSAIC_POOL_THREADS)
    if need_devices:
        jax.config.update("jax_num_cpu_devices", SIMULATED_DEVICES)


@pytest.fixture
def devices8():
    """The 8 simulated CPU devices mesh tests build their meshes from."""
    devices = jax.devices()
    assert len(devices) == SIMULATED_DEVICES, (
        f"{len(devices)} devices, expected {SIMULATED_DEVICES}: jax was initialized before "
        "conftest.py could set jax_num_cpu_devices")
    return devices
