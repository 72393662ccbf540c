"""The SASS audit (titanax.perf.sass_audit): the parser, loops, wgmma windows, claims and the
bound on hand-written SASS (runs everywhere), and on two real deviceless compiles the sm90
forward with fwd_overlap on and off: the overlap the config declares is in the overlapped
kernel's SASS and the same claims, checked on the synchronous kernel, are reported missing."""

import os
import re

import pytest

from pallas_kernels import aot
from titanax.perf import ptxas_report as rep
from titanax.perf import sass_audit as sa

# nvdisasm -c style: a prologue, a loop whose mbarrier wait retries out of line (a stub after
# EXIT that branches back: no loop), S = Q K^T from SMEM and P V with A in registers as two
# wgmma groups, then the softmax. WAIT is what stands between the groups and the softmax.
LOOP = """\
\t.target\tsm_90a
//--------------------- .text.k --------------------------
.text.k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   UMOV UR4, 0x8200490 ;
.L_x_1:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R3 ;
        /*0030*/              @!P1 BRA `(.L_x_9) ;
.L_x_5:
        /*0040*/                   WARPGROUP.ARRIVE ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;
        /*0060*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR22], R24, gsb0 ;
        /*0070*/                   WARPGROUP.ARRIVE ;
        /*0080*/                   HGMMA.64x128x16.F32.BF16 R88, R164, gdesc[UR16].tnspB, R88 ;
        /*0090*/                   HGMMA.64x128x16.F32.BF16 R88, R168, gdesc[UR18].tnspB, R88, gsb0 ;
        /*00a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*00b0*/                   FMNMX.NAN R13, R24, R28, !PT ;
WAIT
        /*00c0*/                   FFMA R14, R24, 0.5, -R13 ;
        /*00d0*/                   MUFU.EX2 R15, R14 ;
        /*00e0*/                   MUFU.EX2 R16, R14 ;
        /*00f0*/                   LDS.128 R40, [R2] ;
        /*0100*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0110*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR7], RZ ;
        /*0120*/                   ISETP.GT.AND P0, PT, R0, 0x3, PT ;
        /*0130*/               @P0 BRA `(.L_x_1) ;
        /*0140*/                   EXIT ;
.L_x_9:
        /*0150*/                   NANOSLEEP.SYNCS 0x10 ;
        /*0160*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R3 ;
        /*0170*/              @!P1 BRA `(.L_x_9) ;
        /*0180*/                   BRA `(.L_x_5) ;
"""
OVERLAPPED = LOOP.replace("WAIT\n", "")  # the wait for P V after the softmax (FA3)
SYNCHRONOUS = LOOP.replace("WAIT\n", "        /*00b8*/                   "
                                     "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n")  # before it
EX2 = sa.Claim("ex2", 0.5, "exp2 under P V")
MMA = sa.Claim("mma", 0.4, "P V issued before S is waited for")


def _audit(text):
    (fn,) = sa.parse_sass(text)
    return fn, sa.audit_function(fn, "sm_90a")


def test_parse_and_loops():
    fn, audit = _audit(OVERLAPPED)
    assert fn.name == "k" and fn.instrs[5].op == "HGMMA.64x128x16.F32.BF16"
    assert fn.instrs[3].pred == "@!P1" and fn.labels[".L_x_9"] == 21
    loops = sa.find_loops(fn)
    # the main loop and the retry self-loop; the stub's branch back to .L_x_5 is no loop
    assert [(lp.body[0].addr, lp.body[-1].addr) for lp in loops] == [(0x20, 0x130),
                                                                      (0x150, 0x170)]
    main = audit["mma"]
    assert main["at"] == "0020-0130"  # the stub (after EXIT) is out of line: not counted
    c = main["counts"]
    assert (c["mma"], c["ex2"], c["fp32"], c["alu"], c["smem"], c["total"]) == (4, 2, 1, 2, 1, 18)
    assert main["mma_kinds"] == "4x HGMMA.64x128x16.F32.BF16"
    assert main["schedule"] == "W A M2 A M2r D1 e2 D0 R"


def test_windows_and_claims():
    _, over = _audit(OVERLAPPED)
    s_win, pv_win = over["mma"]["windows"]
    assert s_win["chain"].startswith("2x HGMMA.64x128x16.F32.BF16 (A smem, acc R24, zero-init")
    assert pv_win["chain"].startswith("2x HGMMA.64x128x16.F32.BF16 (A regs, acc R88")
    assert (s_win["inside"]["mma"], s_win["inside"]["ex2"]) == (2, 0)  # S waited at DEPBAR 1
    assert pv_win["inside"]["ex2"] == 2 and pv_win["waited_in"] == "same iteration"
    assert over["mma"]["overlapped"]["ex2"] == 2 and over["mma"]["overlapped"]["mma"] == 2
    assert sa.check_claims(over, (EX2, MMA)) == []

    _, sync = _audit(SYNCHRONOUS)
    assert sync["mma"]["schedule"] == "W A M2 A M2r D1 D0 e2 D0 R"
    assert sync["mma"]["overlapped"]["ex2"] == 0
    (missing,) = sa.check_claims(sync, (EX2, MMA))  # P V is still issued before S's wait
    assert missing.startswith("claimed overlap missing: exp2 under P V (0 of 2 ex2")
    # a known gap: expected missing; a closed gap is reported as well
    gap = sa.Claim("ex2", 0.5, "exp2 under P V", known_gap="ptxas hoists the wait")
    assert sa.check_claims(sync, (gap,)) == []
    assert sa.check_claims(over, (gap,))[0].startswith("known gap closed")
    assert sa.claim_status(sync, (gap, MMA)) == "ex2: missing (known); mma: holds"


def test_bound_and_shapes():
    _, audit = _audit(OVERLAPPED)
    b = audit["bound"]
    # 4 HGMMA.64x128x16 = 4 x 262144 FLOP at 4096 FLOP/clk/SM; 2 EX2 x 8; LDS.128 x 4 warps
    assert (b["tensor"], b["mufu"], b["fp32"], b["alu"], b["smem"], b["issue"]) == \
        (256, 16, 1, 4, 16, 18)
    assert (b["bound"], b["limiter"]) == (256, "tensor")
    utc = ("\t.target\tsm_100a\n.text.m:\n        /*0000*/   UMOV UR17, 0x8200490 ;\n"
           "        /*0010*/   UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR21], tmem[UR16], "
           "idesc[UR17], !UPT ;\n"
           "        /*0020*/   UMOV UR27, 0x48c00020 ;\n"
           "        /*0030*/   UTCQMMA gdesc[UR4], gdesc[UR6], tmem[UR21], tmem[UR16], "
           "idesc[UR27], tmem[UR9], UPT ;\n")
    (fn,) = sa.parse_sass(utc)
    assert sa.mma_shape(fn, fn.instrs[1]) == (128, 128, 16, 16)  # bf16: M >> 4 in bits 24-28
    assert sa.mma_shape(fn, fn.instrs[3]) == (128, 256, 32, 8)  # MX: M >> 7 in bits 27-28
    assert sa.bound(fn, fn.instrs, [], "sm_100a")["tensor"] == 64 + 128


def test_claims_table():
    row = dict(impl="mosaic_sm90", **{"pass": "fwd"}, variant="causal+fwd_overlap",
               config="FlashConfig(block_q=64, fwd_overlap=True)")
    assert [c.unit for c in sa.claims_for(row)] == ["mma", "ex2"]
    assert sa.claims_for(dict(row, variant="causal", config="FlashConfig(fwd_overlap=False)")) \
        == ()
    assert [c.unit for c in sa.claims_for(dict(row, **{"pass": "dkv"}))] == ["mma"]


def _tools_or_skip():
    """CI installs the CUDA plugin and nvdisasm (bash scripts/dev.sh test): there, their
    absence is a failure, not a skip that would pass the build with nothing checked."""
    why = None
    if not aot.plugin_available():
        why = "CUDA plugin not installed in .venv/cuda-plugin (bash scripts/dev.sh cuda-plugin)"
    elif sa.nvdisasm_path() is None:
        why = "no nvdisasm in the CUDA plugin's nvidia/cuda_nvcc/bin (bash scripts/dev.sh cuda-plugin)"
    if why and os.environ.get("CI"):
        pytest.fail(f"{why}; CI must audit the SASS")
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def sm90_forwards():
    """The sm90 forward at head_dim 64, causal, fwd_overlap off and on: two deviceless compiles
    (seconds), their SASS audited."""
    _tools_or_skip()
    rows = rep.collect("h100", head_dims=(64,), sass=True,
                       only=r"^mosaic_sm90 fwd 64 causal(\+fwd_overlap)?$")
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"causal", "causal+fwd_overlap"}, rows
    return by_variant


def test_fwd_overlap_claims_in_sass(sm90_forwards):
    over, sync = sm90_forwards["causal+fwd_overlap"], sm90_forwards["causal"]
    for r in (over, sync):
        assert "error" not in r["sass"], r["sass"]
    claims = sa.claims_for(over)
    assert [c.unit for c in claims] == ["mma", "ex2"] and sa.claims_for(sync) == ()
    # the overlapped kernel shows what it declares (its known gaps as declared) ...
    assert over["claim_problems"] == [], over["claim_problems"]
    assert over["sass"]["mma"]["overlapped"]["mma"] > 0
    # ... and the synchronous kernel, held to the same claims, fails them: every wgmma group
    # is waited for (DEPBAR.LE gsb0, 0x0) before the next issues
    missing = sa.check_claims(sync["sass"], claims)
    assert any(m.startswith("claimed overlap missing: S_j = Q K_j^T") for m in missing), missing
    assert sync["sass"]["mma"]["overlapped"]["mma"] == 0
    # per tile: 64 x 128 scores; QK^T and PV are 4096 FLOP/clk/SM work of 512 clk at hd64
    assert over["sass"]["bound"]["tensor"] == sync["sass"]["bound"]["tensor"] == 512
    assert over["sass"]["mma"]["counts"]["ex2"] >= 64  # one exp2 per score per thread, + alpha


@pytest.fixture(scope="module")
def sm90_fused_backwards():
    """The sm90 fused backward (FlashConfig.bwd_fused), causal: its asynchronous form at
    head_dim 64 and, at 128, the synchronous form it runs there (kernel_sm90_bwd_fused_sync.py,
    the form before): two deviceless compiles, their SASS audited."""
    _tools_or_skip()
    rows = rep.collect("h100", head_dims=(64, 128), sass=True, fused_bwd=True,
                       only=r"^mosaic_sm90 dqkv (64|128) causal\+bwd_fused$")
    by_hd = {r["head_dim"]: r for r in rows}
    assert set(by_hd) == {64, 128}, rows
    return by_hd


def test_fused_backward_overlaps_in_sass(sm90_fused_backwards):
    """exp2 under dP^T, dS under dV, and dV, dK, dQ waited for once: declared in
    OVERLAP_CLAIMS for the asynchronous form and there in its SASS; the synchronous form (a
    wait per MMA), held to the same claims, fails every one of them."""
    fused, sync = sm90_fused_backwards[64], sm90_fused_backwards[128]
    for r in (fused, sync):
        assert "error" not in r["sass"], r["sass"]
        assert r["ok"], r["why"]  # no spills, no serialized wgmma
        assert r["sass"]["register_order"] == []  # registers given back before any wait
    claims = sa.claims_for(fused)
    assert [c.unit for c in claims] == ["mma", "ex2", "fp32", "mma"], claims
    assert fused["claim_problems"] == [], fused["claim_problems"]
    main = fused["sass"]["mma"]
    assert main["overlapped"]["ex2"] == main["counts"]["ex2"] == 32  # 64 x 64 / 128 threads
    # the five MMAs with three waits: S^T alone (D1, exp2 after it), dP^T alone (D1, dV
    # issued before it), then dV, dK and dQ together (D0; run_state's own wait at the end of
    # the step finds nothing in flight)
    assert re.search(r"M4 M4 D1 e32 A M4r D1 .*A M4 M4 D0 ", main["schedule"]), main
    assert main["schedule"].count("D1") == 2, main
    assert fused["sass"]["bound"]["tensor"] == 640  # 5 x 64 x 64 x 64 x 2 / 4096
    missing = sa.check_claims(sync["sass"], [c for c in claims if c.head_dims])
    assert len(missing) == 3 and all(m.startswith("claimed overlap missing") for m in missing), \
        missing
    assert sync["sass"]["mma"]["overlapped"]["ex2"] == 0



def test_sm100_p_tmem_and_correction_claims_in_sass():
    """fwd_p_tmem's P V reads P from TMEM and fwd_correction's softmax loop waits on no
    mbarrier after its exp2 (sass_audit claims a_tmem, softmax_waits), in the SASS of a
    deviceless sm_100a compile; the shipped forward, held to the same claims, fails both."""
    _tools_or_skip()
    rows = rep.collect("b200", head_dims=(128,), sass=True,
                       only=r"^mosaic_sm100 fwd 128 causal(\+fwd_p_tmem(\+fwd_correction)?)?$")
    by = {r["variant"]: r for r in rows}
    new, shipped = by["causal+fwd_p_tmem+fwd_correction"], by["causal"]
    claims = sa.claims_for(new)
    assert [c.unit for c in claims] == ["a_tmem", "softmax_waits"], claims
    assert new["claim_problems"] == [] and by["causal+fwd_p_tmem"]["claim_problems"] == []
    assert new["sass"]["mma"]["a_tmem"] == 8 and "correction" in new["sass"]
    assert new["ok"] and by["causal+fwd_p_tmem"]["ok"], (new["why"], by["causal+fwd_p_tmem"])
    missing = sa.check_claims(shipped["sass"], claims)
    assert len(missing) == 2 and all(m.startswith("claimed overlap missing") for m in missing)


def test_table_markers():
    text = f"# A\n{rep.BEGIN}\n| ptxas |\n{rep.END}\n{sa.BEGIN}\nold\n{sa.END}\nafter\n"
    new = rep.replace_between_markers(text, "| sass |\n", sa.BEGIN, sa.END)
    assert rep.between_markers(new, sa.BEGIN, sa.END) == "| sass |"
    assert rep.between_markers(new) == "| ptxas |" and new.endswith(f"{sa.END}\nafter\n")


# The sm90 dkv backward with segment ids as ptxas 13 compiled it (4d18d51, trimmed): consumers
# retry setmaxnreg.inc; the producer (from .L_x_0) waits for the range barrier, whose retry
# stub returns to .L_x_60, and only then gives its registers back. It hung on an H200.
ROLES = """\
.text.dkv:
        /*0e10*/                   ISETP.GE.AND P1, PT, R0, 0x100, PT ;
        /*0e20*/               @P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0e50*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;
        /*0e60*/                   PLOP3.LUT P1, PT, PT, PT, UP0, 0x80, 0x0 ;
        /*0e70*/              @!P1 BRA `(.L_x_1) ;
        /*1250*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR17], R6 ;
        /*1260*/              @!P1 BRA `(.L_x_2) ;
        /*5360*/                   BAR.SYNC.DEFER_BLOCKING R42, 0x80 ;
.L_x_0:
        /*5380*/                   UISETP.NE.U32.AND UP0, UPT, UR7, 0x2, UPT ;
        /*5390*/                   PLOP3.LUT P1, PT, PT, PT, UP0, 0x80, 0x0 ;
        /*53a0*/               @P1 EXIT ;
FIRST
.L_x_60:
        /*5410*/                   LDS R4, [UR15+0x10114] ;
THEN
        /*5480*/                   UISETP.GE.AND UP0, UPT, UR6, 0x1, UPT ;
        /*5490*/                   EXIT ;
.L_x_2:
        /*5500*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR17], R6 ;
        /*5510*/              @!P1 BRA `(.L_x_2) ;
        /*5520*/                   BRA `(.L_x_60) ;
.L_x_28:
        /*5530*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R4 ;
        /*5540*/              @!P1 BRA `(.L_x_28) ;
        /*5550*/                   BRA `(.L_x_60) ;
"""
WAIT_RANGE = ("        /*53c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R4 ;\n"
              "        /*53d0*/              @!P1 BRA `(.L_x_28) ;\n")
DEALLOC = "        /*5470*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;\n"


def test_a_warpgroup_must_give_registers_back_before_it_waits():
    (hung,) = sa.parse_sass(ROLES.replace("FIRST\n", WAIT_RANGE).replace("THEN\n", DEALLOC))
    (fixed,) = sa.parse_sass(ROLES.replace("FIRST\n", DEALLOC).replace("THEN\n", WAIT_RANGE))
    (problem,) = sa.register_release_problems(hung)
    assert "mbarrier wait at 53c0" in problem and "DEALLOC at 5470" in problem
    # The consumers' own waits (before .L_x_0) and retry stubs are not the producer's.
    assert sa.register_release_problems(fixed) == []
    row = {"gpu": "h100", "impl": "mosaic_sm90", "pass": "dkv", "head_dim": 128,
           "variant": "causal+segments", "sass": {"register_order": [problem]}}
    assert sa.problems([row]) == [f"h100 mosaic_sm90 dkv hd128 causal+segments: {problem}"]
