"""titanax's kernel collection: pallas_kernels.flash_attention (flash attention behind one
function, `from pallas_kernels.flash_attention import flash_attention`) and pallas_kernels.fp8.

Subpackages load on first import: titanax.config validates backend names against the kernels'
tables (flash_attention/backends.py, fp8/backends.py: plain data) without importing jax.
"""
