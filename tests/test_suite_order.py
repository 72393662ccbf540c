"""The suite hands its longest files to the two workers first (conftest.py, from
tests/durations.json, which scripts/test_durations.py writes from a --durations=0 report)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPORT = """\
============================= slowest durations =============================
134.20s call     tests/test_gpu_check.py::test_loan_command_dry_run
8.50s setup    tests/test_plan.py::test_a
2.25s call     tests/test_plan.py::test_a
0.75s teardown tests/test_plan.py::test_b[x-1]
12.00s call     pallas_kernels/flash/test_mosaic.py::test_fwd
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_durations_are_summed_per_file():
    script = _load(ROOT / "scripts" / "test_durations.py", "test_durations_script")
    assert script.per_file(REPORT) == {"tests/test_gpu_check.py": 134.2,
                                       "pallas_kernels/flash/test_mosaic.py": 12.0,
                                       "tests/test_plan.py": 11.5}
    assert script.per_file("no report here") == {}


def test_longest_files_run_first_and_files_stay_whole(tmp_path, monkeypatch):
    conftest = _load(ROOT / "conftest.py", "root_conftest_copy")
    table = tmp_path / "durations.json"
    table.write_text(json.dumps({"tests/test_a.py": 5.0, "tests/test_b.py": 50.0,
                                 "tests/test_c.py": 1.0}))
    monkeypatch.setattr(conftest, "DURATIONS", table)
    ids = ["tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_b.py::t1",
           "tests/test_c.py::t1", "tests/test_new.py::t1", "tests/test_b.py::t2"]
    items = [types.SimpleNamespace(nodeid=i) for i in ids]
    conftest._longest_files_first(items)
    # b (50 s), then the unknown file at the mean (18.7 s), a (5 s), c (1 s); each file's
    # tests in their own order
    assert [i.nodeid for i in items] == [
        "tests/test_b.py::t1", "tests/test_b.py::t2", "tests/test_new.py::t1",
        "tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_c.py::t1"]
    # The committed table parses, and most of what it names still exists (a renamed file
    # only costs balance until the table is written again).
    shipped = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert sum((ROOT / f).exists() for f in shipped) >= 0.9 * len(shipped) > 0
