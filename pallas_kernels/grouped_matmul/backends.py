"""THE table of grouped_matmul implementations: name -> the function that runs it and what it
needs (pallas_kernels/dispatch.py: the dispatch shape the kernel ops share). grouped_matmul's
dispatch (api.py) and `auto` (api.resolve_impl) read it; adding a backend is one function and
one entry. Plain data, imported without jax; the functions are loaded on first use."""

from __future__ import annotations

import dataclasses

from ..dispatch import impl_names, loader, lookup

load = loader(__name__.rpartition(".")[0])  # relative to pallas_kernels.grouped_matmul


@dataclasses.dataclass(frozen=True)
class Grouped:
    """One grouped_matmul implementation. run: "module:function" called as
    run(x, w, sizes, *, config, interpret, preferred_element_type) -> [M, N].
    compute_capability: the GPU generation (major) a kernel is written for (auto picks it
    there); operand_bytes: the operand width it takes (None: any dtype)."""

    name: str
    summary: str
    run: str
    compute_capability: int | None = None
    operand_bytes: int | None = None


GROUPED: dict[str, Grouped] = {g.name: g for g in (
    Grouped("xla", "jax.lax.ragged_dot: exact on CPU, a dense dot on XLA's GPU lowering "
                   "(the reference, never a GPU path)", run=".api:ragged_dot_xla"),
    Grouped("mosaic_sm90", "jax's Mosaic GPU ragged_dot kernels for Hopper (TMA + wgmma), "
                           "custom VJP", run=".api:grouped_matmul_sm90", compute_capability=9,
            operand_bytes=2),
)}
REFERENCE = "xla"  # auto where no kernel of the target's generation takes the operands
IMPLS = impl_names(GROUPED)  # what grouped_matmul(impl=...) takes


def grouped(name: str) -> Grouped:
    return lookup(GROUPED, name, lambda n: f"grouped matmul impl {n!r}: use one of {IMPLS}")
