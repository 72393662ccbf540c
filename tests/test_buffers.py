"""titanax.plan.buffers: the buffers live at a compiled program's memory peak, from XLA's dumps.
The fixture is a trimmed real XLA:CPU dump (jax 0.11.2) of `sort(x[:, None] * x[None, :])`:
the sort runs in place over the product (two values, one 4 MiB buffer), so a peak that summed
values instead of memory would be wrong."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import aot
from titanax.plan import buffers

BUFFER_ASSIGNMENT = """\
BufferAssignment:
allocation 0: size 4096, page 0, parameter 0, shape |f32[1024]| at ShapeIndex {}:
 value: <33 x.1 @0> (size=4096,offset=0): f32[1024]{0}
allocation 1: size 4, page 0, output shape is |f32[]|, maybe-live-out:
 value: <37 ynn_fusion @0> (size=4,offset=0): f32[]
allocation 2: size 1, page 0, thread-local:
 value: <20 lt_to.1 @0> (size=1,offset=0): pred[]
allocation 7: size 4, page 0, constant:
 value: <2 constant.3 @0> (size=4,offset=0): f32[]
allocation 26: size 4796416, page 0, preallocated-temp:
 value: <34 broadcast_multiply_fusion @0> (size=4194304,offset=0): f32[1024,1024]{1,0}
 value: <35 sort.0 @0> (size=4194304,offset=0): f32[1024,1024]{1,0}
 value: <36 wrapped_slice @0> (size=602112,offset=4194304): f32[1024,147]{1,0}
"""

LIVE_RANGE = """\
HloLiveRange (max 5):
  InstructionSequence:
    0:x.1
    1:broadcast_multiply_fusion
    2:sort.0
    3:wrapped_slice
    4:ynn_fusion
  BufferLiveRange:
    x.1{}:0-5
    broadcast_multiply_fusion{}:1-2
    sort.0{}:2-3
    wrapped_slice{}:3-4
    ynn_fusion{}:4-5
  Live ranges at 3 (peak):
    sort.0{}: 4194304 bytes (cumulative: 4194304 bytes)
    wrapped_slice{}: 602112 bytes (cumulative: 4796416 bytes)
    x.1{}: 4096 bytes (cumulative: 4800512 bytes)
"""

HLO = """\
HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[1024]{0})->f32[]}

FileNames
1 "/tmp/c2.py"

FunctionNames
1 "<module>"
2 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=6 end_line=6 column=4 end_column=64}
2 {file_name_id=1 function_name_id=2 line=4 end_line=4 column=11 end_column=48}
3 {file_name_id=1 function_name_id=2 line=3 end_line=3 column=12 end_column=22}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}


%fused_computation.1 (param_0.2: f32[1024]) -> f32[1024,1024] {
  %param_0.2 = f32[1024]{0} parameter(0)
  ROOT %mul.0 = f32[1024,1024]{1,0} multiply(%mul.2, %mul.1), metadata={op_name="jit(f)/mul" stack_frame_id=3}
}

ENTRY %main.4 (x.1: f32[1024]) -> f32[] {
  %x.1 = f32[1024]{0} parameter(0), metadata={op_name="x"}
  %broadcast_multiply_fusion = f32[1024,1024]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(f)/mul" stack_frame_id=3}, backend_config={"outer_dimension_partitions":["2"]}
  %sort.0 = f32[1024,1024]{1,0} sort(%broadcast_multiply_fusion), dimensions={1}, is_stable=true, to_apply=%region_0.1, metadata={op_name="jit(f)/jit(sort)/sort" stack_frame_id=2}
  %wrapped_slice = f32[1024,147]{1,0} fusion(%sort.0), kind=kLoop, calls=%wrapped_slice_computation, metadata={op_name="jit(f)/slice" stack_frame_id=2}
  ROOT %ynn_fusion = f32[] fusion(%wrapped_slice), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(f)/reduce_sum" stack_frame_id=2}
}
"""


def test_parsers_read_allocations_ranges_and_instructions():
    allocs = {a.index: a for a in buffers.parse_buffer_assignment(BUFFER_ASSIGNMENT)}
    assert [allocs[i].kind for i in (0, 1, 2, 7, 26)] == [
        "parameter", "output", "thread-local", "constant", "temp"]
    assert allocs[0].parameter == 0
    sort = allocs[26].values[1]
    assert (sort.name, sort.index, sort.size, sort.offset) == ("sort.0", "{}", 4194304, 0)
    sequence, ranges = buffers.parse_live_ranges(LIVE_RANGE)
    assert sequence[2] == "sort.0" and ranges["sort.0{}"] == (2, 3) and len(ranges) == 5
    hlo = buffers.parse_hlo(HLO)
    assert hlo["sort.0"].opcode == "sort" and hlo["sort.0"].computation == "main.4"
    assert hlo["sort.0"].op_name == "jit(f)/jit(sort)/sort"
    assert hlo["sort.0"].source == "/tmp/c2.py:4 (f)"
    assert hlo["broadcast_multiply_fusion"].opcode == "fusion kLoop"
    assert hlo["mul.0"].computation == "fused_computation.1"


def test_gpu_style_lines_phi_tuple_values_and_library_frames():
    # a donated Adam moment as the 70B B200 dump writes it: parameter, update and cond phi
    text = ("allocation 0: size 9395240960, page 0, parameter 31, shape |f32[80,1024,28672]| at "
            "ShapeIndex {}, maybe-live-out:\n"
            " value: <1804 wrapped_add.5 @0> (size=9395240960,offset=0): "
            "f32[80,1024,28672]{2,1,0}\n"
            " value: <2633 conditional.1{5} (phi) @0> (size=9395240960,offset=0): "
            "f32[80,1024,28672]{2,1,0}\n")
    (alloc,) = buffers.parse_buffer_assignment(text)
    assert alloc.kind == "parameter" and alloc.parameter == 31   # not heap, though live-out
    phi = alloc.values[1]
    assert (phi.key, phi.phi, phi.size) == ("conditional.1{5}", True, 9395240960)
    # an optax op: the leaf frame is in the library, so our caller is named too (XLA prints
    # parent_frame_id one too high: frame 2's parent is frame 1)
    hlo = buffers.parse_hlo(
        'FileNames\n1 "/r/src/titanax/train/step.py"\n'
        '2 "/r/.venv/lib/python3.12/site-packages/optax/_src/transform.py"\n'
        'FunctionNames\n1 "train_step"\n2 "update_fn"\n'
        'FileLocations\n1 {file_name_id=1 function_name_id=1 line=68}\n'
        '2 {file_name_id=2 function_name_id=2 line=1029}\n'
        'StackFrames\n1 {file_location_id=1 parent_frame_id=1}\n'
        '2 {file_location_id=2 parent_frame_id=2}\n\n'
        'ENTRY %main (p: f32[]) -> (f32[], f32[]) {\n'
        '  ROOT %t = (f32[], /*index=1*/f32[]) fusion(%p), kind=kLoop, calls=%c, '
        'metadata={op_name="jit(train_step)/mul" stack_frame_id=2}\n}\n')
    assert hlo["t"].opcode == "fusion kLoop"
    assert hlo["t"].source == ("optax/_src/transform.py:1029 (update_fn) <- "
                               "/r/src/titanax/train/step.py:68 (train_step)")


def test_peak_counts_shared_memory_once():
    r = buffers.peak_buffers(BUFFER_ASSIGNMENT, LIVE_RANGE, HLO, top=5)
    # t=2: product and sort share offset 0 (4 MiB, not 8); t=3: sort + slice = the allocation
    assert r["peak_bytes"] == 4194304 + 602112 == r["heap_allocation_bytes"] - 4
    assert r["peak_at"]["instruction"] == "wrapped_slice"
    first, second = r["top"]
    assert (first["bytes"], first["shape"], first["value"]) == (4194304, "f32[1024,1024]",
                                                                 "sort.0{}")
    assert first["op_name"] == "jit(f)/jit(sort)/sort" and first["source"] == "/tmp/c2.py:4 (f)"
    assert second["op_name"] == "jit(f)/slice"
    assert r["top_fraction"] == 1.0
    # without live ranges: every heap buffer, an upper bound, still one row per byte range
    r = buffers.peak_buffers(BUFFER_ASSIGNMENT, None, HLO, top=1)
    assert r["peak_at"] is None and r["top"][0]["bytes"] == 4194304
    lines = buffers.format_buffers(r)
    assert "f32[1024,1024]" in lines[1] and "jit(f)/" in lines[2]


def test_host_memory_allocations_are_not_the_device_peak():
    # full_offload's saved layer inputs as the 70B H100 dump writes them: a preallocated temp
    # of memory color 5 (pinned host, S(5) layouts), live across the whole loop
    host = ("allocation 27: size 1073741824, color 5, page 0, preallocated-temp:\n"
            " value: <8843 wrapped_dynamic-update-slice.3 @5> (size=1073741824,offset=0): "
            "bf16[8,1,8192,8192]{3,2,1,0:S(5)}\n")
    live = LIVE_RANGE.replace("    ynn_fusion{}:4-5\n",
                              "    ynn_fusion{}:4-5\n    wrapped_dynamic-update-slice.3{}:0-5\n")
    allocs = buffers.parse_buffer_assignment(BUFFER_ASSIGNMENT + host)
    assert allocs[-1].kind == "host"
    r = buffers.peak_buffers(BUFFER_ASSIGNMENT + host, live, HLO, top=5)
    assert r["peak_bytes"] == 4194304 + 602112          # as without it
    assert all(row["allocation"] != 27 for row in r["top"])


def _big_temp(x):
    outer = x[:, None] * x[None, :]                        # f32[1024,1024]: 4 MiB
    return jnp.sort(outer, axis=1)[:, ::7].sum()


def test_compiled_function_reports_its_largest_temporary():
    lowered = jax.jit(_big_temp).lower(jax.ShapeDtypeStruct((1024,), jnp.float32))
    compiled, r = buffers.compile_with_buffers(lowered, top=3)
    assert compiled(jnp.ones(1024)) == pytest.approx(1024 * 147)    # still a working executable
    top = r["top"][0]
    assert top["bytes"] == 1024 * 1024 * 4 and top["shape"] == "f32[1024,1024]"
    assert "sort" in top["op_name"] and "test_buffers.py" in top["source"]
    assert r["peak_bytes"] <= r["memory_analysis"]["temp_size_in_bytes"] + 4
    assert 0.8 <= r["top_fraction"] <= 1.0


@pytest.mark.skipif(not aot.plugin_available(), reason="CUDA plugin not installed")
def test_deviceless_gpu_compile_of_tiny_train_step():
    from titanax.config import load_config
    from titanax.plan import Cluster
    from titanax.plan.cluster import plan_config
    from titanax.plan.compile import compile_in_subprocess

    cluster = Cluster("h100", 1, 1)     # the smallest step: XLA:GPU still takes ~15 s
    overrides = ["model.n_layers=1", "train.batch_size=2", "train.seq_len=128"]
    cfg = plan_config(load_config(aot.REPO / "configs/tiny.py", overrides), cluster)
    result = compile_in_subprocess(cfg, cluster, buffers=4)
    assert result["ok"] and result["target"] == "gpu", result.get("error")
    r, m = result["peak_buffers"], result["memory"]
    assert len(r["top"]) == 4 and r["top"][0]["bytes"] >= r["top"][-1]["bytes"] > 0
    assert 0 < r["peak_bytes"] <= m["temporaries"] + m["outputs"]
    assert any(row["op_name"].startswith("jit(train_step)") for row in r["top"])
