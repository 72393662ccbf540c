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


def test_fused_dq_producer_releases_registers_before_any_wait(monkeypatch):
    """The fused backward's producer (kernel_sm90_bwd_fused.dq_producer, which also hands each
    consumer's dQ tile to TMA) keeps the order: registers back, then the range, then the
    ring and the dQ tiles."""
    from pallas_kernels.flash_attention import kernel_sm90_bwd_fused as fused

    events = []
    fake = types.SimpleNamespace(
        set_max_registers=lambda regs, action: events.append(("setmaxnreg", action, regs)),
        barrier_wait=lambda bar: events.append(("wait", bar)),
        barrier_arrive=lambda bar: events.append(("arrive", bar)),
        wait_smem_to_gmem=lambda *a, **k: events.append(("wait_tma",)))
    bars = types.SimpleNamespace(at={0: "empty0", 1: "empty1"})
    monkeypatch.setattr(fused, "plgpu", fake)
    monkeypatch.setattr(fused.pl, "when", lambda cond: lambda f: None)  # no loads, no loop
    monkeypatch.setattr(fused.pl, "loop", lambda lo, hi: lambda f: None)
    fused.dq_producer(None, "consumed", bars, None, total=lambda: events.append(("total",)) or 3,
                      steps=2, regs=24, range_ready="range_ready")
    assert events[:3] == [("setmaxnreg", "decrease", 24), ("wait", "range_ready"), ("total",)]
    assert ("arrive", "empty0") in events and ("arrive", "empty1") in events
