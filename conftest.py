"""Test set-up for tests/ and pallas_kernels/, done before jax starts: 8 simulated CPU devices
so mesh tests can run anywhere, and an XLA CPU thread pool wider than this machine's cores.

Why the pool: the Mosaic GPU interpreter runs each warpgroup of a kernel as its own XLA CPU
computation, and a warpgroup waiting on an mbarrier blocks a pool thread inside a host
callback. XLA sizes the pool by the core count (2 on CI), so two waiting warpgroups could
starve the third, the one they wait for, and the kernel hung. PJRT_NPROC sets the size."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
