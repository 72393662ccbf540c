"""Writes tests/durations.json, the seconds each test file takes, which conftest.py reads to
hand the longest files to the two test workers first.

    bash scripts/dev.sh test --durations=0 | tee /tmp/suite.log
    .venv/bin/python scripts/test_durations.py /tmp/suite.log

Reads pytest's duration report ('12.34s call     tests/test_x.py::test_y', setup and
teardown too) and sums it per file. Run it on a 2-core machine after a change moves a file's
time by a minute or more; a stale table only costs balance, never correctness.
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import sys

LINE = re.compile(r"^\s*([\d.]+)s\s+(?:setup|call|teardown)\s+(\S+?\.py)::")
OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def per_file(report: str) -> dict[str, float]:
    seconds: dict[str, float] = collections.defaultdict(float)
    for line in report.splitlines():
        if m := LINE.match(line):
            seconds[m.group(2)] += float(m.group(1))
    return {f: round(s, 1) for f, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python scripts/test_durations.py PYTEST_LOG (a run with --durations=0)")
    seconds = per_file(pathlib.Path(argv[0]).read_text())
    if not seconds:
        sys.exit(f"error: {argv[0]} has no duration report; run pytest with --durations=0")
    OUT.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"wrote {OUT}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
