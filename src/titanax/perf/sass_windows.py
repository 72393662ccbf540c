"""What a loop issues while its matmuls are in flight (part of the SASS audit,
titanax.perf.sass_audit): Hopper's wgmma groups and their windows, and a loop's schedule of
synchronisation and matmul events in one line.

Overlap windows (Hopper's wgmma; loop_windows): a chain of HGMMAs ending in one with `gsb0` is
a committed group; `WARPGROUP.DEPBAR.LE gsb0, N` waits until at most N groups are outstanding,
retiring the oldest first. A group's window runs from its first HGMMA to the DEPBAR that
retires it; the audit walks the loop body twice (a group committed in iteration j may be waited
for in j+1) and counts, by class, what is issued inside each window, and over the second walk
how many of each class are issued while any group is in flight ("overlapped"). Blackwell's
tcgen05 MMAs complete through mbarriers (UTCBAR) that other warps wait on: their overlap is
between warps, so sm100 kernels get counts, schedule and bound but no windows. What the SASS
does say about them, and their claims check (Claim units "a_tmem" and "softmax_waits"): which
UTC*MMAs read their A operand from TMEM (`UTCHMMA tmem[..], gdesc[..], ..`: the P V of
FlashConfig.fwd_p_tmem), and whether the softmax loop waits on an mbarrier after its first
MUFU.EX2 (the shipped forward's wait for P_{t-1} V before it rescales O; fwd_correction moves
that to a correction warpgroup, whose loop, no matmul and no EX2 but TMEM loads and stores,
is the "correction" role).
"""

from __future__ import annotations

from titanax.perf.sass_parse import MMA_HOPPER, Instr, classify

# --- wgmma groups and their windows --------------------------------------------------------------

WINDOW_CLASSES = ("mma", "ex2", "fp32", "alu", "smem", "sync", "total")


def _wgmma(ins: Instr) -> bool:
    return ins.base in MMA_HOPPER


def _chain_name(chain: list[Instr]) -> str:
    first = chain[0]
    regs_a = not first.args.split(",")[1].strip().startswith("gdesc")
    acc = first.args.split(",")[0].strip()
    zero = ", zero-init" if ", RZ" in first.args else ""
    return f"{len(chain)}x {first.op} (A {'regs' if regs_a else 'smem'}, acc {acc}{zero})"


def loop_windows(body: list[Instr]) -> dict:
    """The wgmma groups of one loop iteration and what is issued inside each one's window (its
    first HGMMA to the WARPGROUP.DEPBAR that retires it, possibly in the next iteration), and
    per class how many instructions of the second (steady-state) iteration issue while a group
    other than their own is in flight ("overlapped")."""
    outstanding, chain, groups = [], None, []
    overlapped = dict.fromkeys(WINDOW_CLASSES, 0)
    for it in (0, 1):
        for pos, ins in enumerate(body):
            cls = classify(ins)
            # in flight: the committed groups, and the open chain unless `ins` extends it
            in_flight = outstanding + ([chain] if chain and not _wgmma(ins) else [])
            if _wgmma(ins):
                if chain is None:
                    chain = dict(iteration=it, issued=pos, mma=[], inside=dict.fromkeys(
                        WINDOW_CLASSES, 0), waited=None)
                chain["mma"].append(ins)
                if "gsb0" in ins.args:
                    outstanding.append(chain)
                    groups.append(chain)
                    chain = None
            elif ins.op.startswith("WARPGROUP.DEPBAR") and "gsb0" in ins.args:
                keep = int(ins.args.split(",")[-1], 0)
                while len(outstanding) > keep:
                    outstanding.pop(0)["waited"] = (it, pos)
            for g in in_flight:
                for key in (cls, "total"):
                    if key in g["inside"]:
                        g["inside"][key] += 1
            if it == 1 and in_flight:
                for key in (cls, "total"):
                    if key in overlapped:
                        overlapped[key] += 1
    windows = [dict(chain=_chain_name(g["mma"]), issued_at=g["issued"],
                    waited_at=None if g["waited"] is None else g["waited"][1],
                    waited_in=("same iteration" if g["waited"] and g["waited"][0] == 0 else
                               "next iteration" if g["waited"] else "after the loop"),
                    inside=g["inside"])
               for g in groups if g["iteration"] == 0]
    return dict(windows=windows, overlapped=overlapped)


def schedule(body: list[Instr]) -> str:
    """The loop's synchronisation and matmul events in order, runs compressed: A wgmma fence
    (WARPGROUP.ARRIVE), Mn a chain of n matmuls (Mnr: A from registers), Dn WARPGROUP.DEPBAR.LE
    gsb0 n, C tcgen05 commit (UTCBAR), W mbarrier wait, R mbarrier arrive, B named barrier, eN N
    MUFU.EX2 issued since the previous event."""
    tokens, ex2, chain = [], 0, []

    def flush_chain():
        if chain:
            regs_a = _wgmma(chain[0]) and not chain[0].args.split(",")[1].strip().startswith("g")
            tokens.append(f"M{len(chain)}{'r' if regs_a else ''}")
            chain.clear()

    for ins in body:
        op, cls = ins.op, classify(ins)
        token = ("A" if op == "WARPGROUP.ARRIVE" else
                 f"D{int(ins.args.split(',')[-1], 0)}" if op.startswith("WARPGROUP.DEPBAR") else
                 "C" if ins.base == "UTCBAR" else
                 "W" if op.startswith(("SYNCS.PHASECHK", "SYNCS.WAIT")) else
                 "R" if op.startswith("SYNCS.ARRIVE") else
                 "B" if ins.base == "BAR" else None)
        if cls == "mma":
            if ex2:
                tokens.append(f"e{ex2}")
                ex2 = 0
            chain.append(ins)
            if "gsb0" in ins.args:
                flush_chain()
            continue
        if cls == "ex2":
            ex2 += 1
        if token is None:
            continue
        if chain:
            flush_chain()
        if ex2:
            tokens.append(f"e{ex2}")
            ex2 = 0
        tokens.append(token)
    flush_chain()
    if ex2:
        tokens.append(f"e{ex2}")
    out = []
    for t in tokens:  # runs of one event: "Ax3"
        if out and out[-1][0] == t and t[0] in "ADWRBC":
            out[-1][1] += 1
        else:
            out.append([t, 1])
    return " ".join(t if n == 1 else f"{t}x{n}" for t, n in out)
