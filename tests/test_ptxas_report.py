"""Machine code of every GPU kernel at its shipped config (titanax.perf.ptxas_report): no
register spills and within the SM's register, shared memory and TMEM budgets, on H100 and
B200, deviceless. Plus the parsers on literal compiler output, which run everywhere."""

import os
import re
import time

import pytest

from launch.ptxas_report import DOCS
from pallas_kernels import aot
from titanax.perf import ptxas_report as rep
from titanax.perf import sass_audit

# `ptxas -v` as Mosaic prints it, a spilling kernel first, with a device function's properties
# in between (they must not be taken for the entry's).
PTXAS_SAMPLE = """\
ptxas warning : Registers are spilled to local memory in function 'entry_mosaic_gpu_kernel', \
460 bytes spill stores, 496 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'entry_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for entry_mosaic_gpu_kernel
    352 bytes stack frame, 460 bytes spill stores, 496 bytes spill loads
ptxas info    : Used 232 registers, used 16 barriers, 352 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compile time = 348.092 ms
ptxas info    : Function properties for __internal_trig_reduction
    40 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function 'titanax_flash_fwd' for 'sm_100a'
ptxas info    : Function properties for titanax_flash_fwd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 171 registers, used 1 barriers, 400 bytes cmem[0]
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized \
due to non wgmma instructions defining accumulator registers of a wgmma between start and end \
of the pipeline stage in the function 'titanax_flash_fwd'
"""

RESOURCES_SAMPLE = (
    "Resources(smem_scratch_bytes=166912, tmem_scratch_cols=256, tmem_collective_scratch_cols=0,"
    " barrier_counts=Counter({Barrier(arrival_count=1, num_barriers=2, orders_tensor_core=False)"
    ": 5}), scoped_gmem_semaphores={})")

THUNKS_SAMPLE = """\
001: kCustomKernel [source       | next=002 (1)] input_reduce_fusion grid: [2048, 1, 1] \
threads: [256, 1, 1]  shared_memory: 0 bytes
002: kCustomKernel [prev=001 (1) | sink        ] titanax_flash_bwd_dkv grid: [32, 1, 1] \
threads: [256, 1, 1]  shared_memory: 107008 bytes
"""


def test_parse_ptxas_sample():
    spill, clean = rep.parse_ptxas(PTXAS_SAMPLE)
    assert spill == dict(kernel="entry_mosaic_gpu_kernel", arch="sm_90a", registers=232,
                         stack_bytes=352, spill_stores=460, spill_loads=496, static_smem=1,
                         wgmma_serialized=None)
    assert clean == dict(kernel="titanax_flash_fwd", arch="sm_100a", registers=171,
                         stack_bytes=0, spill_stores=0, spill_loads=0, static_smem=0,
                         wgmma_serialized="C7515: due to non wgmma instructions defining "
                         "accumulator registers of a wgmma between start and end of the "
                         "pipeline stage")


def test_parse_other_dumps():
    assert rep.parse_resources(RESOURCES_SAMPLE) == [dict(smem_bytes=166912, tmem_cols=256)]
    assert rep.ptx_threads(".visible .entry k(\n.maxntid 384, 1, 1\n)") == [384]
    assert rep.parse_thunks(THUNKS_SAMPLE) == {"input_reduce_fusion": (256, 0),
                                               "titanax_flash_bwd_dkv": (256, 107008)}
    hlo = ('%p = custom-call(%q), custom_call_target="__gpu$xla.gpu.triton", backend_config='
           '{debug = false, ir = "ML\\EFR", name = "titanax_flash_fwd", num_warps = 8 : i32}')
    assert rep.triton_kernel_names(hlo + "\n%f = fusion(%p), calls=%x") == {"titanax_flash_fwd"}


def test_verdict_budgets():
    row = dict(registers=168, threads=384, spill_stores=0, spill_loads=0, smem_bytes=166912,
               tmem_cols=None)
    assert rep.verdict(row) == dict(ok=True, why="ok")
    bad = dict(row, registers=232, spill_stores=4, smem_bytes=240000, tmem_cols=640,
               wgmma_serialized="C7510: due to insufficient register resources")
    why = rep.verdict(bad)["why"]
    assert "spills 4 B" in why and "232 registers x 384 threads" in why
    assert "wgmma serialized (C7510: due to insufficient register resources)" in why
    assert "240000 B shared memory" in why and "640 TMEM columns" in why
    assert rep.verdict(dict(error="boom")) == dict(ok=False, why="compile failed: boom")


def test_replace_between_markers():
    text = f"# A\n{rep.BEGIN}\nold | table\n{rep.END}\nafter\n"
    assert rep.replace_between_markers(text, "| new |\n") == \
        f"# A\n{rep.BEGIN}\n| new |\n{rep.END}\nafter\n"


def _plugin_or_skip():
    """CI installs the CUDA plugin (bash scripts/dev.sh test): there, its absence is a failure,
    not a skip that would pass the build with nothing checked."""
    if aot.plugin_available():
        return
    why = "CUDA plugin not installed in .venv/cuda-plugin (bash scripts/dev.sh cuda-plugin installs it)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must compile the kernels")
    pytest.skip(why)


def test_every_kernel_within_budgets():
    _plugin_or_skip()
    start = time.monotonic()
    # Llama's head_dim and the register-heaviest one; `python -m launch.ptxas_report` adds 64.
    head_dims = (128, 256)
    # With the SASS audit where nvdisasm is (CI installs it: there a missing one fails below).
    sass = sass_audit.nvdisasm_path() is not None or bool(os.environ.get("CI"))
    rows = rep.collect_all(("h100", "b200"), head_dims=head_dims, sass=sass)  # side by side
    seen = {(r["gpu"], r["op"], r["impl"]) for r in rows}
    for kind, impls in (("h100", ("mosaic_sm90", "triton")), ("b200", ("mosaic_sm100", "triton"))):
        assert all((kind, "attention", impl) in seen for impl in impls), seen
    assert ("h100", "fp8_matmul", "sm90") in seen and ("b200", "fp8_matmul", "sm100") in seen
    problems = rep.check(rows)
    assert not problems, (f"{len(problems)} kernel(s) over budget "
                          f"({time.monotonic() - start:.0f} s):\n" + "\n".join(problems))
    # The tables in docs/ are this run's: a kernel change without `python -m
    # launch.ptxas_report --write-docs` leaves them stale, and this says which.
    for op, doc in DOCS.items():
        text = (aot.REPO / doc).read_text()
        shipped = text[text.index(rep.BEGIN) + len(rep.BEGIN):text.index(rep.END)].strip()
        fresh = rep.markdown_table([r for r in rows if r["op"] == op]).strip()
        ours = {ln for ln in shipped.splitlines()[2:]  # the rows at the head dims compiled
                if not re.search(r"\| (\d+) \| (causal|full)", ln)
                or int(re.search(r"\| (\d+) \| (causal|full)", ln).group(1)) in head_dims}
        stale = sorted(ours ^ set(fresh.splitlines()[2:]))
        assert not stale, (f"{doc}'s ptxas table differs from a fresh run (python -m "
                           "launch.ptxas_report --write-docs):\n" + "\n".join(stale[:8]))
    if sass:
        _check_sass(rows, head_dims)


def _check_sass(rows, head_dims):
    """Every kernel's declared overlaps are in its SASS (titanax.perf.sass_audit), and the SASS
    tables in docs/ are this run's at the head dims compiled, as the ptxas tables above."""
    problems = sass_audit.problems(rows)
    assert not problems, f"{len(problems)} SASS audit problem(s):\n" + "\n".join(problems)
    hd = re.compile(r"^\| \w+ \| \w+ \| \w+ \| (\d*) \|")
    for op, doc in DOCS.items():
        shipped = rep.between_markers((aot.REPO / doc).read_text(), sass_audit.BEGIN,
                                      sass_audit.END)
        fresh = sass_audit.markdown_table([r for r in rows if r["op"] == op])
        ours = {ln for ln in shipped.splitlines()[2:]
                if not hd.match(ln).group(1) or int(hd.match(ln).group(1)) in head_dims}
        stale = sorted(ours ^ set(fresh.splitlines()[2:]))
        assert not stale, (f"{doc}'s SASS table differs from a fresh run (python -m "
                           "launch.ptxas_report --sass --write-docs):\n" + "\n".join(stale[:8]))
