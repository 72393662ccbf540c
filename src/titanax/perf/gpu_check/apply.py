"""`python -m launch.gpu_check --apply RESULTS`: a loan's gpu_check.json into the repository, so
that one loan updates it in one commit (docs/gpu_check.md, "Recording the results").

Three files change:
- docs/bench/gpu_check_<gpu>.json: the result as it came back;
- docs/performance.md: the section `## GPU: <device kind>` between the markers
  `<!-- gpu-check:<gpu>:begin -->` and `<!-- gpu-check:<gpu>:end -->` (added after the
  introduction on the first run of that GPU), holding the command, the date, the versions and
  the kernels, train, attention and fp8 tables;
- pallas_kernels/measured.py: WINS for this GPU generation. Our kernel wins an op when it beats
  the vendor path by at least MARGIN on every case measured: attention without documents
  (`vs_cudnn_causal`, at every sequence length, the training length among them), tensorwise
  FP8 (`vs_xla_fp8` at every 70B GEMM shape), rowwise FP8 (against `xla_rowwise`), MXFP8
  (against `xla_mx`, cuDNN's block-scaled GEMM). A generation's entry that the run measured and did not confirm is removed. And
  TUNED, from the choices section: where a tunable choice's fastest variant beats the one
  running now by MARGIN, its knobs become this generation's default (none when it is the
  shipped table's own config); where the one running now holds, nothing changes. And
  VERIFIED: an attention kernel of this generation (or the portable one) whose kernels-section
  rows all passed against the reference (every head dim and document layout it ran, none
  failing or raising, and no section finding it failing or hung) is recorded as checked on
  this GPU generation, so `auto` runs it without a run's own first-contact check
  (titanax/train/attention_check.py); one the run measured and did not confirm is removed.
  And FAILED: an attention kernel the run's suspects name (failed, raised or hung), per
  document layout, so `auto` routes around it on this generation; an entry whose layout the
  run ran and passed is removed. Knobs of a kernel the run found failing are never adopted
  into TUNED.

Nothing is written unless the whole result reads: a dry run, a CPU result or one without its
device section is refused with the reason.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

# A win must hold by 2% or more: the medians of 10-20 timed calls move by about 1% between
# runs of one machine.
MARGIN = 1.02
TRAINING_SEQ = 8192
MEASURED = "pallas_kernels/measured.py"
PERFORMANCE = "docs/performance.md"
# measured.py's table: empty on one line, or one entry per line up to a closing brace line.
_WINS_RE = re.compile(r"^WINS: dict\[tuple\[str, int\], str\] = (?:\{\}|\{\n.*?^\})$",
                      re.M | re.S)
_TUNED_RE = re.compile(r"^TUNED: dict\[tuple\[str, int\], dict\] = (?:\{\}|\{\n.*?^\})$",
                       re.M | re.S)
_VERIFIED_RE = re.compile(
    r"^VERIFIED: dict\[tuple\[str, int\], str\] = (?:\{\}|\{\n.*?^\})$", re.M | re.S)


class ApplyError(ValueError):
    """The result cannot be applied; the message says why and what to do."""


def load(path: pathlib.Path) -> dict:
    try:
        rep = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ApplyError(f"cannot read {path}: {e}") from None
    if not isinstance(rep, dict) or "sections" not in rep:
        raise ApplyError(f"{path} is not a gpu_check.json (no 'sections')")
    if rep.get("dry_run"):
        raise ApplyError(f"{path} is a dry run: it holds CPU stand-ins, not GPU numbers")
    info = rep["sections"].get("device", {}).get("info", {})
    if info.get("platform") != "gpu" or not info.get("compute_capability") or not info.get("gpu"):
        raise ApplyError(f"{path}: its device section names no known GPU (platform "
                         f"{info.get('platform')!r}, gpu {info.get('gpu')!r}); run it on the GPU "
                         "with the device section")
    return rep


def _ok_rows(rep: dict, section: str) -> list[dict]:
    return [r for r in rep["sections"].get(section, {}).get("rows", []) if r.get("status") == "ok"]


def decide(rep: dict) -> dict[str, tuple[str | None, str]]:
    """{op: (our impl that won or None, evidence)} for the ops this run measured."""
    from pallas_kernels.fp8.bench import BASELINES, CASES, case_kernel

    out: dict[str, tuple[str | None, str]] = {}
    ours = rep["sections"].get("attention", {}).get("info", {}).get("ours")
    rows = [r for r in _ok_rows(rep, "attention")
            if r.get("impl") == ours and not r.get("documents") and "vs_cudnn_causal" in r]
    if ours and rows:
        ratio = min(r["vs_cudnn_causal"] for r in rows)
        seqs = sorted(r["seq"] for r in rows)
        won = ratio >= MARGIN and TRAINING_SEQ in seqs
        out["attention"] = (ours if won else None,
                            f"vs_cudnn_causal >= {ratio:.3f} at S={seqs}")
    fp8 = _ok_rows(rep, "fp8")
    shapes = {(r["m"], r["k"], r["n"]) for r in fp8}
    for op, scaling, base in (("fp8_tensorwise", "tensorwise", "xla_fp8"),
                              ("fp8_rowwise", "rowwise", "xla_rowwise"),
                              ("mxfp8", "mx", "xla_mx")):
        vendor = {(r["m"], r["k"], r["n"]): r["tflops"] for r in fp8 if r["impl"] == base}
        # Bench cases name a kernel and its scaling (sm90, sm90_rowwise): ours of this mode.
        cases = {r["impl"]: case_kernel(r["impl"])[0] for r in fp8 if r["impl"] in CASES
                 and r["impl"] not in BASELINES and case_kernel(r["impl"])[1] == scaling}
        for case, impl in sorted(cases.items()):
            mine = {(r["m"], r["k"], r["n"]): r["tflops"] for r in fp8 if r["impl"] == case}
            both = sorted(set(mine) & set(vendor))
            if not both:
                continue
            ratio = min(mine[s] / vendor[s] for s in both)
            won = ratio >= MARGIN and set(both) == shapes
            out[op] = (impl if won else None,
                       f"{case} / {base} TFLOP/s >= {ratio:.3f} at {len(both)} of "
                       f"{len(shapes)} shapes")
    return out


def verify(rep: dict, major: int) -> dict[str, str | None]:
    """{attention impl: evidence, or None where this run measured it and did not confirm it}
    for our kernels of this GPU generation (and the portable one) that the kernels section
    ran: confirmed when every row that ran passed (status ok, pass True), rows ran with and
    without packed documents, and no section failed or hung on it (the run's suspects)."""
    from pallas_kernels.flash_attention.backends import BACKENDS, KERNEL_IMPLS
    from titanax.perf.gpu_check.context import attention_key

    kernels = rep["sections"].get("kernels", {})
    rows = [r for r in kernels.get("rows", []) if r.get("kernel") == "flash_attention"]
    died_in = (kernels.get("current") or {}).get("uses", [])
    out: dict[str, str | None] = {}
    for impl in KERNEL_IMPLS:
        if BACKENDS[impl].compute_capability not in (None, major):
            continue
        ran = [r for r in rows if r.get("impl") == impl
               and r.get("status") in ("ok", "fail", "error")]
        keys = {attention_key(impl, documents) for documents in (False, True)}
        bad = keys & (set(rep.get("suspects") or {}) | set(died_in))
        if not ran and not bad:
            continue  # not measured: an earlier run's entry stands
        good = [r for r in ran if r.get("status") == "ok" and r.get("pass") is True]
        if bad or len(good) != len(ran):
            out[impl] = None
            continue
        if {bool(r.get("segments")) for r in good} != {False, True}:
            continue  # one document layout checked: the other is the first contact's to check
        dims = "/".join(str(d) for d in sorted({int(r.get("head_dim") or 0) for r in good}))
        layouts = ", ".join(sorted({"documents" if r.get("segments") else "causal"
                                    for r in good}))
        out[impl] = (f"{len(good)} case{'s' * (len(good) > 1)} matching the reference "
                     f"(head_dim {dims}; {layouts})")
    return out


def failures(rep: dict, major: int) -> dict[str, str | None]:
    """{'<impl>:documents' or ':causal': what this run saw it do, or None where the kernels
    section ran it and every row passed} for our attention kernels of this GPU generation
    (and the portable one): a kernel the run's suspects name (it failed, raised, or hung in a
    section) is recorded in measured.FAILED, so `auto` routes around it on this generation."""
    from pallas_kernels.flash_attention.backends import BACKENDS, KERNEL_IMPLS

    ours = {i for i in KERNEL_IMPLS if BACKENDS[i].compute_capability in (None, major)}
    out: dict[str, str | None] = {}
    rows = [r for r in rep["sections"].get("kernels", {}).get("rows", [])
            if r.get("kernel") == "flash_attention" and r.get("impl") in ours]
    for impl in ours:
        for documents in (False, True):
            ran = [r for r in rows if r["impl"] == impl and bool(r.get("segments")) == documents
                   and r.get("status") in ("ok", "fail", "error")]
            if ran and all(r.get("status") == "ok" and r.get("pass") for r in ran):
                out[f"{impl}:{'documents' if documents else 'causal'}"] = None
    for key, why in (rep.get("suspects") or {}).items():
        kernel, _, rest = key.partition(":")
        impl, _, layout = rest.partition(":")
        if kernel == "flash_attention" and impl in ours:
            out[f"{impl}:{layout or 'causal'}"] = why
    return out


def tune(rep: dict) -> dict[str, tuple[dict, str]]:
    """{config name: (knobs, evidence)} for the tunable choices this run measured both ways:
    the faster variant's FlashConfig knobs, a knob None where the shipped table's own value won
    (its TUNED entry goes). Several choices tune one config (the sm90 forward's overlap and
    persistence, its fused backward): their knobs merge. Unchanged where the variant running
    now held."""
    by_choice: dict[str, list[dict]] = {}
    for r in _ok_rows(rep, "choices"):
        if r.get("tunes") and "ms" in r:
            by_choice.setdefault(r["choice"], []).append(r)
    # A kernel the run saw fail or hang (in any layout) gets no new defaults from it: its
    # variants were timed on the layout that works, and would ship to the one that does not.
    suspect = {k.split(":")[1] for k in (rep.get("suspects") or {})
               if k.startswith("flash_attention:")}
    out = {}
    for name, rows in sorted(by_choice.items()):
        now = [r for r in rows if r.get("shipped")]
        if not now or len(rows) < 2 or any(r.get("impl") in suspect for r in rows):
            continue
        best = min(rows, key=lambda r: r["ms"])
        ratio = now[0]["ms"] / best["ms"]
        if best is now[0] or ratio < MARGIN:
            continue
        knobs = {k: None for k in best["knobs"]} if best.get("base") else dict(best["knobs"])
        why = f"{name}: {best['variant']} {ratio:.3f}x faster than {now[0]['variant']}"
        had, why_had = out.get(best["tunes"], ({}, ""))
        out[best["tunes"]] = ({**had, **knobs}, f"{why_had}; {why}" if why_had else why)
    return out


def _set(knobs: dict) -> dict:
    """The knobs a tuning sets (None: back to the shipped table's value)."""
    return {k: v for k, v in knobs.items() if v is not None}


def _knobs_source(knobs: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in sorted(knobs.items())) + "}"


_WINS_DECL, _TUNED_DECL = "WINS: dict[tuple[str, int], str]", "TUNED: dict[tuple[str, int], dict]"
_VERIFIED_DECL = "VERIFIED: dict[tuple[str, int], str]"
_FAILED_DECL = "FAILED: dict[tuple[str, int], str]"
_FAILED_RE = re.compile(r"^FAILED: dict\[tuple\[str, int\], str\] = (?:\{\}|\{\n.*?^\})$",
                        re.M | re.S)


def _table_source(decl: str, table: dict, comments: dict, value=repr) -> str:
    """measured.py's `decl = {...}`: one (name, major) entry per line, with its comment."""
    if not table:
        return f"{decl} = {{}}"
    lines = [f"{decl} = {{"]
    for (name, major), v in sorted(table.items()):
        comment = comments.get((name, major))
        lines.append(f"    ({name!r}, {major}): {value(v)},{f'  # {comment}' if comment else ''}")
    return "\n".join(lines + ["}"])


def _existing_comments(source: str) -> dict:
    found = {}
    for m in re.finditer(r"^\s+\('(\w+)', (\d+)\): '(\w+)',(?:\s+# (.*))?$", source, re.M):
        found[(m.group(1), int(m.group(2)))] = m.group(4)
    return found


def _tuned_comments(source: str) -> dict:
    found = {}
    for m in re.finditer(r"^\s+\('([\w/]+)', (\d+)\): \{.*?\},(?:\s+# (.*))?$", source, re.M):
        found[(m.group(1), int(m.group(2)))] = m.group(3)
    return found


def update_measured(source: str, decisions: dict, major: int, run: str,
                    tuning: dict | None = None, verifying: dict | None = None,
                    failing: dict | None = None) -> str:
    """measured.py's source with this run's WINS decisions, TUNED knobs and VERIFIED kernels
    (verify()'s {impl: evidence or None}) for GPU generation `major`."""
    namespace: dict = {}
    exec(compile(source, MEASURED, "exec"), namespace)  # noqa: S102 - our own file
    wins, comments = dict(namespace["WINS"]), _existing_comments(source)
    for op, (impl, evidence) in decisions.items():
        if impl:
            wins[(op, major)] = impl
            comments[(op, major)] = f"{run}: {evidence}"
        else:
            wins.pop((op, major), None)
    for pattern, table in ((_WINS_RE, _WINS_DECL), (_TUNED_RE, _TUNED_DECL),
                           (_VERIFIED_RE, _VERIFIED_DECL)):
        if not pattern.search(source):
            raise ApplyError(f"{MEASURED}: no `{table} = {{...}}` to rewrite")
    source = _WINS_RE.sub(lambda m: _table_source(_WINS_DECL, wins, comments), source, count=1)
    tuned, t_comments = dict(namespace["TUNED"]), _tuned_comments(source)
    for name, (knobs, evidence) in (tuning or {}).items():
        entry = {**tuned.get((name, major), {}), **knobs}  # other choices' knobs stay
        entry = {k: v for k, v in entry.items() if v is not None}  # None: the shipped table's
        if entry:
            tuned[(name, major)] = entry
            t_comments[(name, major)] = f"{run}: {evidence}"
        else:
            tuned.pop((name, major), None)
    source = _TUNED_RE.sub(lambda m: _table_source(_TUNED_DECL, tuned, t_comments,
                                                   _knobs_source), source, count=1)
    checked = dict(namespace["VERIFIED"])
    for impl, evidence in (verifying or {}).items():
        if evidence:
            checked[(impl, major)] = f"{run}: {evidence}"
        else:
            checked.pop((impl, major), None)
    source = _VERIFIED_RE.sub(lambda m: _table_source(_VERIFIED_DECL, checked, {}), source,
                              count=1)
    if not _FAILED_RE.search(source):
        raise ApplyError(f"{MEASURED}: no `{_FAILED_DECL} = {{...}}` to rewrite")
    broken = dict(namespace.get("FAILED", {}))
    for key, why in (failing or {}).items():
        if why:
            broken[(key, major)] = f"{run}: {why}"
        else:
            broken.pop((key, major), None)
    return _FAILED_RE.sub(lambda m: _table_source(_FAILED_DECL, broken, {}), source, count=1)


def performance_section(rep: dict, decisions: dict, tuning: dict | None = None,
                        verifying: dict | None = None, failing: dict | None = None) -> str:
    from titanax.perf.gpu_check import report

    info = rep["sections"]["device"]["info"]
    lines = [f"## GPU: {info.get('device_kind')}, jax {info.get('jax')}, "
             f"{str(rep.get('started', ''))[:10]}", "",
             f"`{rep.get('command', '')}` (`docs/bench/gpu_check_{info['gpu']}.json`; the tables "
             "are gpu_check.md's). Compute capability "
             f"{info.get('compute_capability')}, CUDA plugin {info.get('cuda_plugin')}, cuDNN "
             f"{info.get('cudnn')}, driver {info.get('cuda_driver')}; {rep.get('elapsed_s', 0):.0f} s "
             f"of a {rep.get('time_limit_s', 0):.0f} s limit."]
    not_ok = {n: s.get("status") for n, s in rep["sections"].items()
              if s.get("status") not in ("ok", "skipped")}
    if not_ok:
        lines += ["", "Not complete: " + ", ".join(f"{n} {s}" for n, s in not_ok.items()) + "."]
    if rep.get("suspects"):
        lines += ["", "Kernels skipped after failing or hanging: " + "; ".join(
            f"`{k}` ({v})" for k, v in rep["suspects"].items()) + "."]
    kernels = rep["sections"].get("kernels", {}).get("rows", [])
    if kernels:
        ran = [r for r in kernels if r.get("status") in ("ok", "fail", "error")]
        bad = [r for r in kernels if r.get("status") in ("fail", "error")]
        lines += ["", f"Kernels against their references: {len(ran) - len(bad)} of {len(ran)} "
                      "cases pass" + (":" if bad else ".")]
        if bad:
            lines += ["", report.rows_table(bad)]
    for name, title in (("train", "Train step"), ("attention", "Attention"), ("fp8", "FP8 GEMMs"),
                        ("choices", "Kernel choices (A/B)")):
        sec = rep["sections"].get(name)
        if not sec or not sec.get("rows"):
            continue
        lines += ["", f"### {title}", "", sec.get("what", "")]
        lines += ["", *report.tables(sec["rows"])]
    if decisions:
        lines += ["", "`auto` after this run (pallas_kernels/measured.py): " + "; ".join(
            f"{op}: {impl or 'vendor'} ({evidence})" for op, (impl, evidence) in
            sorted(decisions.items())) + "."]
    if tuning:
        lines += ["", "Kernel defaults after this run (pallas_kernels/measured.py TUNED): " +
                  "; ".join(f"{name}: {_knobs_source(_set(knobs)) if _set(knobs) else 'the shipped table'} "
                            f"({evidence})" for name, (knobs, evidence) in sorted(tuning.items()))
                  + "."]
    if verifying:
        lines += ["", "Attention kernels checked against the reference on this GPU generation "
                      "(pallas_kernels/measured.py VERIFIED): " + "; ".join(
                          f"{impl}: {evidence or 'not confirmed (an earlier entry goes)'}"
                          for impl, evidence in sorted(verifying.items())) + "."]
    if any(failing.values() if failing else ()):
        lines += ["", "Attention kernels that failed on this GPU generation, which `auto` now "
                      "routes around (pallas_kernels/measured.py FAILED): " + "; ".join(
                          f"{key}: {why}" for key, why in sorted(failing.items()) if why) + "."]
    return "\n".join(lines)


def update_performance(text: str, gpu: str, section: str) -> str:
    begin, end = f"<!-- gpu-check:{gpu}:begin -->", f"<!-- gpu-check:{gpu}:end -->"
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        return text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    text = text.replace("No GPU numbers yet: no session has had a GPU machine. The GPU benchmarks "
                        "are\n`python -m launch.bench attention` and `python -m launch.bench fp8`."
                        "\n\n", "")
    first = text.find("\n## ")
    if first < 0:
        return text.rstrip("\n") + "\n\n" + block + "\n"
    return text[:first + 1] + block + "\n\n" + text[first + 1:]


def apply(results: pathlib.Path, repo: pathlib.Path) -> list[pathlib.Path]:
    """Writes the three files (module docstring); returns their paths."""
    rep = load(results)
    info = rep["sections"]["device"]["info"]
    gpu, major = info["gpu"], int(str(info["compute_capability"]).split(".")[0])
    decisions, tuning, verifying = decide(rep), tune(rep), verify(rep, major)
    failing = failures(rep, major)
    run = f"{info.get('device_kind')} {str(rep.get('started', ''))[:10]}"
    measured = repo / MEASURED
    new_measured = update_measured(measured.read_text(), decisions, major, run, tuning,
                                   verifying, failing)
    perf = repo / PERFORMANCE
    new_perf = update_performance(perf.read_text(), gpu,
                                  performance_section(rep, decisions, tuning, verifying,
                                                      failing))
    bench = repo / "docs" / "bench" / f"gpu_check_{gpu}.json"
    bench.parent.mkdir(parents=True, exist_ok=True)
    if pathlib.Path(results).resolve() != bench.resolve():
        shutil.copyfile(results, bench)
    measured.write_text(new_measured)
    perf.write_text(new_perf)
    return [bench, perf, measured]
