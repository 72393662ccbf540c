"""The overlaps each kernel config declares (OVERLAP_CLAIMS) and whether its SASS audit shows
them (part of the SASS audit, titanax.perf.sass_audit): a claim works on the audit's JSON
(titanax.perf.sass_audit.audit_function), not on the SASS.
"""

from __future__ import annotations

import dataclasses

# --- declared overlaps ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Claim:
    """An overlap a kernel config declares, checkable in its SASS: at least `min_fraction` of
    the main loop's instructions of class `unit` ("ex2": MUFU.EX2, "mma": matmuls) issue while a
    wgmma group other than their own is in flight (loop_windows' "overlapped"). Two units
    are Blackwell's structure instead (no wgmma windows there): "a_tmem", at least
    `min_fraction` of the main loop's MMAs read A from TMEM; "softmax_waits", the softmax loop
    waits on no mbarrier after its first exp2 (min_fraction unused).
    known_gap: why the SASS does not show it (yet): the check then expects it missing, so that
    a fix shows up ("known gap closed") as well as a regression. head_dims: the head dims it
    is claimed at (empty: all)."""

    unit: str
    min_fraction: float
    what: str
    known_gap: str = ""
    head_dims: tuple = ()


_FWD_OVERLAP_EX2_GAP = (
    "ptxas moves the wgmma.wait_group 0 for P_{j-1} V_{j-1}, which the PTX places after tile "
    "j's softmax, ahead of it (DEPBAR.LE gsb0, 0x0 a dozen FMNMX after S_j's wait, before the "
    "first MUFU.EX2): with ptxas 13.0 at every head dim, with 12.9 at head_dim 64 (12.9 keeps "
    "64 of the 66 exp2 in the window at 128)")

# (impls, passes, strings that must all appear in the row's variant or config repr, claims).
# A config that claims nothing intra-warpgroup is absent: the shipped sm90 forward waits for
# each wgmma group before using it and overlaps across its two warpgroups (the ping-pong).
OVERLAP_CLAIMS = (
    (("mosaic_sm90",), ("fwd",), ("fwd_overlap=True",), (
        Claim("mma", 0.15, "S_j = Q K_j^T and P_{j-1} V_{j-1} in flight together (P V issued "
                           "before S_j is waited for: 4 of 20 MMAs at head_dim 256)"),
        Claim("ex2", 0.5, "tile j's exp2 under P_{j-1} V_{j-1} (FA3 Algorithm 2)",
              known_gap=_FWD_OVERLAP_EX2_GAP),
    )),
    (("mosaic_sm90",), ("dq", "dkv", "dqkv"), (), (
        Claim("mma", 0.15, "S and dP issued together, one wait (the second chain issues while "
                           "the first is in flight)"),
    )),
    # The fused backward's asynchronous form (kernel_sm90_bwd_fused.py, head_dim <= its
    # ASYNC_MAX_HEAD_DIM; above, the synchronous form claims only the S/dP pair above).
    (("mosaic_sm90",), ("dqkv",), ("bwd_fused=True",), (
        Claim("ex2", 0.9, "P^T = exp2(S^T - lse) while dP^T = V dO^T is in flight (FA3)",
              head_dims=(64,)),
        Claim("fp32", 0.9, "the exp2 FMAs under dP^T and dS^T = P^T (dP^T - delta) under "
                           "dV += P^T dO", head_dims=(64,)),
        Claim("mma", 0.6, "dV, dK and dQ issued as one chain, waited for once (and S^T with "
                          "dP^T)", head_dims=(64,)),
    )),
    # The sm100 forward's FA4 forms (kernel_sm100.py): P V reads P from TMEM (the P V MMAs: 8
    # of 16 at head_dim 128, 8 of 12 at 64); with the correction warpgroup the softmax loop no
    # longer waits for P_{t-1} V after its exponentials (the O rescale's wait).
    (("mosaic_sm100",), ("fwd",), ("fwd_p_tmem=True",), (
        Claim("a_tmem", 0.3, "P_t V_t issued with P read from TMEM (tcgen05 A operand), no "
                             "P tile in SMEM"),
    )),
    (("mosaic_sm100",), ("fwd",), ("fwd_correction=True",), (
        Claim("softmax_waits", 0.0, "no tensor-core wait in the softmax loop after its exp2: "
                                    "the O rescale (after P_{t-1} V) is the correction "
                                    "warpgroup's"),
    )),
    (("sm90",), ("matmul",), ("promote_every=0",), (
        Claim("mma", 0.5, "each K step's wgmma in flight while the next one issues "
                          "(promote_every=0, delay_release=1)"),
    )),
)


def claims_for(row: dict) -> tuple[Claim, ...]:
    """The claims of a report row's kernel: every claim is a Mosaic kernel's (a Mosaic impl's
    backward at head_dim 256 runs the Triton grid kernels, which claim nothing)."""
    if row.get("backend", "mosaic") != "mosaic":
        return ()
    text = f"{row.get('variant', '')} {row.get('config', '')}"
    return tuple(c for impls, passes, needs, claims in OVERLAP_CLAIMS
                 if row.get("impl") in impls and row.get("pass") in passes
                 and all(n in text for n in needs) for c in claims
                 if not c.head_dims or row.get("head_dim") in c.head_dims)


def claim_holds(audit: dict, claim: Claim) -> bool:
    if claim.unit == "softmax_waits":
        return (audit.get("softmax") or {}).get("waits_after_ex2", 1) == 0
    loop = audit.get("mma") or {}
    if claim.unit == "a_tmem":
        total = loop.get("counts", {}).get("mma", 0)
        return total > 0 and loop.get("a_tmem", 0) >= claim.min_fraction * total
    total = loop.get("counts", {}).get(claim.unit, 0)
    over = loop.get("overlapped", {}).get(claim.unit, 0)
    return total > 0 and over >= claim.min_fraction * total


def check_claims(audit: dict, claims) -> list[str]:
    """One line per claim whose status differs from what is declared: missing from the SASS,
    or (a known gap) present after all; [] when all are as declared."""
    out = []
    for c in claims:
        holds = claim_holds(audit, c)
        if not holds and not c.known_gap:
            out.append(f"claimed overlap missing: {c.what} ({_fraction(audit, c)})")
        elif holds and c.known_gap:
            out.append(f"known gap closed (update OVERLAP_CLAIMS): {c.what} "
                       f"({_fraction(audit, c)})")
    return out


def _fraction(audit: dict, c: Claim) -> str:
    loop = audit.get("mma") or {}
    if c.unit == "softmax_waits":
        waits = (audit.get("softmax") or {}).get("waits_after_ex2", "no softmax loop: ?")
        return f"{waits} mbarrier waits after the softmax loop's first exp2, claimed 0"
    if c.unit == "a_tmem":
        return (f"{loop.get('a_tmem', 0)} of {loop.get('counts', {}).get('mma', 0)} MMAs "
                f"with A in TMEM, claimed >= {c.min_fraction:.0%}")
    return (f"{loop.get('overlapped', {}).get(c.unit, 0)} of "
            f"{loop.get('counts', {}).get(c.unit, 0)} {c.unit} in a window, "
            f"claimed >= {c.min_fraction:.0%}")


def claim_status(audit: dict, claims) -> str:
    """The table's cell: each claim's unit and whether the SASS shows it."""
    if not claims:
        return "none"
    cells = []
    for c in claims:
        holds = claim_holds(audit, c)
        state = "holds" if holds else "missing (known)" if c.known_gap else "**MISSING**"
        cells.append(f"{c.unit}: {state}")
    return "; ".join(cells)


def annotate(row: dict) -> dict:
    """A worker row with its SASS audit (`sass`) -> plus `claims` (the cell) and
    `claim_problems` (check_claims' lines)."""
    audit = row.get("sass")
    if not audit or "error" in audit:
        return row
    claims = claims_for(row)
    return dict(row, claims=claim_status(audit, claims),
                claim_problems=check_claims(audit, claims))


def problems(rows: list[dict]) -> list[str]:
    """One line per kernel whose SASS audit failed, whose declared overlaps are not as
    declared, or whose warpgroup waits before giving registers back; [] when all are."""
    out = []
    for r in rows:
        label = f"{r['gpu']} {r['impl']} {r['pass']} hd{r.get('head_dim')} {r['variant']}"
        if "sass" in r and "error" in r["sass"]:
            out.append(f"{label}: SASS audit: {r['sass']['error']}")
        out += [f"{label}: {p}" for p in r.get("sass", {}).get("register_order", ())]
        out += [f"{label}: {p}" for p in r.get("claim_problems", ())]
    return out
