"""Test set-up: 8 simulated CPU devices (set before jax starts) so mesh tests can run anywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
