"""What fp8_matmul(impl='auto') means here, read from the implementation table (backends.py).

XLA's FP8 dot (cuBLASLt) for tensorwise scales and XLA's scaled matmul (cuDNN) for MX ones,
unless a benchmark recorded in docs/ shows our kernel for this GPU generation faster
(pallas_kernels/measured.py) and it takes the shape. With interpret=True: the Pallas grid
kernel in interpret mode. Logged once per choice.
"""

from __future__ import annotations

import functools
import logging

from .. import measured
from ..target import compute_capability
from .backends import (
    INTERPRET_DEFAULT,
    MATMULS,
    MEASURED_OP,
    VENDOR,
    generation_kernels,
    load,
    matmul,
)

log = logging.getLogger(__name__)


@functools.cache
def _log_once(msg: str) -> None:
    log.warning(msg)


def takes_shape(name: str, m: int, n: int, k: int, config=None) -> bool:
    """Whether implementation `name` takes an [m, k] x [k, n] product with this config (its
    default config when `config` is not one of its own)."""
    impl = MATMULS[name]
    if impl.supported is None:
        return True
    cls = load(impl.config)
    return load(impl.supported)(m, n, k, config if isinstance(config, cls) else cls())


def our_kernel(cc, mode: str, m: int, n: int, k: int, config=None) -> str | None:
    """Our kernel for this GPU generation and scaling mode when it takes the shape."""
    fits = [g.name for g in generation_kernels(cc[0], mode) if takes_shape(g.name, m, n, k, config)]
    return fits[0] if fits else None


def resolve_impl(impl: str, mode: str, m: int, n: int, k: int, *, interpret: bool = False,
                 config=None) -> str:
    """The implementation 'auto' means for a `mode` ('tensorwise' or 'mx') product of this
    shape; any other name is checked against the table and returned as it is."""
    if impl != "auto":
        return matmul(impl).name
    if interpret:
        return INTERPRET_DEFAULT
    cc = compute_capability()
    if cc is None:
        return VENDOR
    op = MEASURED_OP[mode]
    ours = our_kernel(cc, mode, m, n, k, config)
    if ours is not None and measured.ours_won(op, cc, ours):
        _log_once(f"fp8_matmul auto: using {ours!r} for {op}: {measured.WHERE} records it "
                  f"beating XLA on compute capability {cc[0]}.{cc[1]}")
        return ours
    kernels = ", ".join(n for n, x in MATMULS.items() if x.run.startswith(".matmul_"))
    _log_once(f"fp8_matmul auto: using {VENDOR!r} for {op} on compute capability "
              f"{cc[0]}.{cc[1]}: no benchmark in {measured.WHERE} shows a titanax kernel "
              f"faster there (ours stay one impl= away: {kernels})")
    return VENDOR
