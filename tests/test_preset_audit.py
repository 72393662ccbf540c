"""The shipped GPU presets compile, for GPUs we do not have, to a step that does only the work
it needs (titanax.plan.preset_audit, plan/audit.py): causal attention without anything S x S,
our kernels for packed documents, every GEMM in a library or kernel call, matmul FLOPs within
10% of what the step must execute.

CI compiles one cell (~50 s on 2 cores, the suite's time is spent): the 70B preset as shipped
on Hopper (cuDNN causal, bf16 cuBLAS), the program the issue found computing a dense mask. The
other paths are compiled by smaller tests: our Mosaic kernels as context-parallel blocks for
H100 and B200 (test_context.py), the FP8 GEMMs' accumulation and MXFP8's block-scaled GEMMs
(pallas_kernels/fp8/test_accumulation.py), the audit's findings on small steps
(test_audit.py). `python -m launch.audit_presets` runs all 54 cells (3 presets x H100/B200 x
each recipe x documents on/off, about 50 minutes); docs/planner.md holds that table, every
cell passing."""

import pytest

from pallas_kernels import aot
from titanax.plan import preset_audit
from titanax.plan.preset_audit import Cell

pytestmark = pytest.mark.skipif(not aot.plugin_available(), reason="CUDA plugin not installed "
                                "in .venv/cuda-plugin (bash scripts/dev.sh cuda-plugin installs it)")

CELLS = [Cell("llama3_70b", "h100", "default", False)]


@pytest.fixture(scope="module")
def rows():
    return {Cell(**r["cell"]): r for r in preset_audit.audit_cells(CELLS)}


@pytest.mark.parametrize("cell", CELLS, ids=Cell.label)
def test_preset_passes_the_audit(rows, cell):
    row = rows[cell]
    assert row["ok"], row.get("error")
    assert row["findings"] == [], row["findings"]
    assert row["s_by_s"] == 0
    # What runs the attention: cuDNN's causal kernel without documents, ours with them.
    if cell.documents:
        assert row["attention"] == ["Mosaic GPU kernel (in kernel)"], row["attention"]
    else:
        assert row["attention"] == ["cuDNN fMHA (CAUSAL)"], row["attention"]
    # Every GEMM in a library: FP8 recipes in FP8 GEMMs (block-scaled for MXFP8), no loop
    # fusion anywhere (the audit's findings would name it).
    want = {"default": "cuBLASLt", "fp8_delayed": "cuBLASLt f8", "fp8_tensorwise": "cuBLASLt f8",
            "mxfp8": "cuDNN"}[cell.precision]
    assert any(g.startswith(want) for g in row["gemms"]), row["gemms"]
    assert 0.9 < row["ratio"] <= 1.1, row["ratio"]
