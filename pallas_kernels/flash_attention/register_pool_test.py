"""The register pool of the sm90 backwards (no GPU, no interpreter can show it): a warpgroup's
setmaxnreg.inc blocks until another's setmaxnreg.dec returns registers to the CTA's pool, so a
producer must release its registers before it waits on anything a consumer makes after its
own increase. The dkv and fused backwards with packed documents waited for the consumer's
range copy first and hung on an H200 (docs/performance.md); the Mosaic GPU interpreter, which
models no register pool, passed them. This checks the order of the calls."""

import types

from pallas_kernels.flash_attention import mosaic_common


def test_q_ring_producer_releases_registers_before_waiting_for_the_range(monkeypatch):
    events = []
    fake = types.SimpleNamespace(
        set_max_registers=lambda regs, action: events.append(("setmaxnreg", action, regs)),
        barrier_wait=lambda bar: events.append(("wait", bar)),
        copy_gmem_to_smem=lambda *a, **k: events.append(("copy",)))
    monkeypatch.setattr(mosaic_common, "plgpu", fake)
    monkeypatch.setattr(mosaic_common, "ring_producer",
                        lambda total, steps, load, consumed, regs: events.append(
                            ("ring", regs)))
    mosaic_common.q_ring_producer((None,) * 5, (None,) * 5, (None,) * 5, "consumed", batch=0,
                                  kv_head=0, G=1, bq=64, q_start=lambda: 0,
                                  per_head=lambda: 1, steps=2, regs=24,
                                  range_ready="range_ready")
    assert events == [("setmaxnreg", "decrease", 24), ("wait", "range_ready"), ("ring", None)]
