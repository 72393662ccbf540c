"""What a section sees while it runs in its worker process: its budget, and a result file that is
rewritten after every row, so a section killed at its time limit still leaves the rows it
finished (and names the one it was in).

Row status: 'ok', 'fail' (ran, outside its tolerance), 'error' (raised; the message is kept),
'n/a' (this GPU or this run cannot do the case; the reason is kept), 'warning' (fine to run,
worth reading: a package off its pin) or 'skipped' (the section's budget could not cover it). No jax import here: the runner's parent process stays free of it.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
import traceback

ROW_OK = ("ok", "n/a", "warning")  # warning: worth reading, not a failure (a version pin)
# The runner hands each section the kernels that failed or hung in an earlier one, as JSON
# {key: why}; keys name a kernel and its variant (attention_key, fp8_key).
SUSPECTS_ENV = "TITANAX_GPU_CHECK_SUSPECTS"


def attention_key(impl: str, documents: bool) -> str:
    """The suspects' key of an attention kernel: impl, and its segment-id variant."""
    return f"flash_attention:{impl}" + (":documents" if documents else "")


def fp8_key(impl: str, mode: str) -> str:
    return f"fp8_matmul:{impl}:{mode}"


def suspects_from_env() -> dict:
    try:
        return dict(json.loads(os.environ.get(SUSPECTS_ENV) or "{}"))
    except ValueError:
        return {}


def write_json(path: pathlib.Path, data) -> None:
    """Atomic: a reader (the parent, or a person after a timeout) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def error_text(e: BaseException, limit: int = 600) -> str:
    return f"{type(e).__name__}: {str(e)[:limit]}"


def row_status(row: dict) -> str:
    if row.get("error"):
        return "error"
    if row.get("pass") is False:
        return "fail"
    return row.get("status", "ok")


class SectionContext:
    def __init__(self, name: str, path: pathlib.Path, *, dry_run: bool, budget_s: float):
        self.name, self.path, self.dry_run, self.budget_s = name, path, dry_run, budget_s
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.info: dict = {}
        self.markdown: str | None = None  # a section's own table (ptxas), instead of the rows'
        self.current: dict | None = None
        self._slowest: dict[str, float] = {}
        # A kernel that hung or failed earlier is not run again: a hang would spend this
        # section's budget too, a fault would end it.
        self.suspects = suspects_from_env()
        self.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def time_left(self) -> float:
        return self.budget_s - self.elapsed()

    def note(self, **info) -> None:
        self.info.update(info)
        self.flush()

    def add(self, row: dict) -> dict:
        row.setdefault("status", row_status(row))
        self.rows.append(row)
        self.flush()
        return row

    def run_item(self, label: dict, fn, *, estimate_s: float, group: str = "",
                 uses: tuple = ()) -> dict:
        """One row: label plus what fn() returns. An exception becomes the row's error and the
        section goes on. Before starting, the item must fit the budget left, judged by the
        slowest item of its group so far (compiles dominate, and they are alike within a
        group), or estimate_s for the first; otherwise it is recorded as skipped. `uses`: the
        kernels it runs (attention_key, fp8_key); one that failed or hung in an earlier section skips
        the row, and a row of this one that fails marks them for the later sections."""
        label = {**label, "uses": list(uses)} if uses else label
        bad = [u for u in uses if u in self.suspects]
        if bad:
            return self.add({**label, "status": "skipped",
                             "reason": "; ".join(f"{u}: {self.suspects[u]}" for u in bad)})
        need = self._slowest.get(group, estimate_s)
        if self.time_left() < need:
            return self.add({**label, "status": "skipped",
                             "reason": f"section budget: {self.time_left():.0f}s left, this "
                                       f"takes ~{need:.0f}s"})
        self.current = label
        self.flush()
        t = time.monotonic()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - one case failing must not stop the section
            traceback.print_exc()
            result = {"error": error_text(e)}
        dt = time.monotonic() - t
        self._slowest[group] = max(self._slowest.get(group, 0.0), dt)
        self.current = None
        return self.add({**label, **(result or {}), "seconds": round(dt, 2)})

    def result(self, status: str = "running", error: str | None = None) -> dict:
        out = {"status": status, "seconds": round(self.elapsed(), 2), "budget_s": self.budget_s,
               "dry_run": self.dry_run, "info": self.info, "rows": self.rows}
        if self.markdown is not None:
            out["markdown"] = self.markdown
        if self.current is not None:
            out["current"] = self.current
        if error:
            out["error"] = error
        return out

    def final_status(self) -> str:
        """'skipped' when the section says so, 'fail' when a row failed or raised, 'partial'
        when the budget left rows out, else 'ok'."""
        if self.info.get("skipped"):
            return "skipped"
        states = {r["status"] for r in self.rows}
        if states - set(ROW_OK) - {"skipped"} or self.info.get("problems"):
            return "fail"
        return "partial" if "skipped" in states else "ok"

    def flush(self, status: str = "running", error: str | None = None) -> None:
        write_json(self.path, self.result(status, error))
