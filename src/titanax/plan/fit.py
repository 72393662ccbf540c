"""The smallest change that makes a train step fit its devices' memory, among the changes that
leave the run's result as it is: train.grad_accum (the step's gradient is still the mean over
the same global batch), model.remat (the same math, recomputed or moved to host memory) and,
for a run that already keeps its optimizer in host memory, train.offload_params (the master
weights join it there). Layout and batch changes, and host offload for a run that asked for
none, are launch.plan --search's business.

launch.train calls `fit_to_devices` before its first step (compiling on the real mesh);
launch.plan runs `search_fit` inside its deviceless compile (compile.py) and prints the answer
as the line to copy. Both measure candidates by compiling them, smallest change first:
grad_accum up the divisors of the per-device batch, then each remat policy that saves more
than the configured one (search.REMATS order), with grad_accum from the configured up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from titanax.config import Config, ConfigError, apply_overrides
from titanax.plan.search import REMATS
from titanax.train import memory_fit

GB = 1e9


def size(n: float) -> str:
    """Bytes as the planner prints them (GB = 1e9); MB for the small models of tests."""
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


# measure(cfg) -> {'memory': memory_fit.compiled_memory(...), ...}; raises if it cannot compile
Measure = Callable[[Config], dict]


@dataclasses.dataclass
class FitAnswer:
    need: dict[str, int]        # the memory of the config as given (compiled_memory)
    capacity: int               # bytes per device it must fit in
    where: str                  # where the capacity comes from, for the message
    overrides: dict | None = None  # the smallest change that fits; None: none found
    fit_bytes: int = 0          # its memory per device
    fit_result: dict | None = None  # measure()'s answer for it
    tried: list[dict] = dataclasses.field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.need["total"] <= self.capacity

    def set_flags(self) -> str:
        return " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in (self.overrides or {}).items())

    def head(self) -> str:
        return (f"the train step needs {size(self.need['total'])} per device of "
                f"{size(self.capacity)} ({self.where})")

    def line(self) -> str:
        """One line: fits, or what it needs of what, and the --set that fits (or why none)."""
        head = self.head()
        if self.fits:
            return f"{head}: fits"
        if self.overrides:
            return f"{head}; {self.set_flags()} fits ({size(self.fit_bytes)})"
        state = state_bytes(self.need)
        if state >= self.capacity:
            why = (f"{size(state)} of it is the train state and batch, which no "
                   "train.grad_accum or model.remat shrinks")
        else:
            why = f"no train.grad_accum or model.remat setting fits ({len(self.tried)} compiled)"
        return (f"{head}; {why}: see python -m launch.plan --search for host offload "
                "(train.offload_optimizer), other layouts (mesh.context splits long "
                "sequences), or more GPUs")


def state_bytes(memory: dict[str, int]) -> int:
    """What every candidate still needs: the arguments (state, batch) and new outputs."""
    return memory["arguments"] + memory["outputs"] - memory["aliased"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(cfg: Config, batch_ways: int) -> Iterator[dict]:
    """Overrides, smallest change first. batch_ways: mesh data x fsdp (resolved)."""
    micro = cfg.pipeline.microbatches if cfg.mesh.pipeline > 1 else 1
    per_device = cfg.train.batch_size // (batch_ways * micro)
    start = cfg.train.known_grad_accum
    ladder = [k for k in _divisors(max(per_device, 1)) if k >= start]
    for k in ladder[1:]:
        yield {"train.grad_accum": k}
    remat = "dots" if cfg.model.remat == "dots_no_batch" else cfg.model.remat
    for policy in REMATS[REMATS.index(remat) + 1:]:
        for k in ladder:
            yield {"model.remat": policy, "train.grad_accum": k}
    # The optimizer already in host memory: the layers' fp32 master weights may follow it (the
    # same math and result; each microbatch reads them over the host link, which the plan
    # prices). With several microbatches that needs the sum in place: full or full_offload.
    t = cfg.train
    if t.offload_optimizer and not t.offload_params and cfg.mesh.pipeline <= 1:
        for policy in REMATS[max(REMATS.index(remat), REMATS.index("full")):]:
            for k in ladder:
                yield {"train.offload_params": True, "model.remat": policy,
                       "train.grad_accum": k}


def search_fit(cfg: Config, measure: Measure, capacity: int, where: str, batch_ways: int,
               *, need: dict | None = None, log=None) -> FitAnswer:
    """cfg's memory (measured, or `need` when known) against capacity; when it does not fit,
    the first candidate that does. Candidates the config rejects are skipped; one that fails
    to compile is recorded and skipped. Nothing is searched when the state alone is too big."""
    say = log or (lambda *_a: None)
    need = need if need is not None else measure(cfg)["memory"]
    answer = FitAnswer(need, capacity, where)
    if answer.fits or state_bytes(need) >= capacity:
        return answer
    say(f"memory check: {answer.head()}; compiling the smallest changes that could fit")
    for overrides in candidates(cfg, batch_ways):
        try:
            c_cfg = apply_overrides(cfg, overrides)
        except ConfigError:
            continue
        label = " ".join(f"{k}={v}" for k, v in overrides.items())
        try:
            result = measure(c_cfg)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped
            answer.tried.append({"overrides": overrides, "error": str(e).splitlines()[0][:300]})
            say(f"  {label}: does not compile ({type(e).__name__})")
            continue
        total = result["memory"]["total"]
        answer.tried.append({"overrides": overrides, "bytes": total})
        say(f"  {label}: {size(total)}")
        if total <= capacity:
            answer.overrides, answer.fit_bytes, answer.fit_result = overrides, total, result
            break
    return answer


def fit_to_devices(cfg: Config, mesh, log=print):
    """launch.train's check before the state is built: (cfg as it will run on mesh, with
    train.grad_accum=auto resolved and logged; its compiled train step, or None when there
    was nothing to check against). DoesNotFit (one line with the --set that fits) when the
    step needs more memory than the devices have."""
    capacity = memory_fit.device_capacity(cfg, mesh)
    auto = cfg.train.grad_accum_auto
    start = apply_overrides(cfg, {"train.grad_accum": 1}) if auto else cfg
    if capacity is None:  # a CPU without train.device_memory_limit: nothing to check against
        if auto:
            log("train.grad_accum=auto -> 1 (no device memory limit on this platform; set "
                "train.device_memory_limit to fit one)")
        return start, None

    def measure(c: Config) -> dict:
        compiled = memory_fit.compile_train_step(c, mesh)
        return {"memory": memory_fit.compiled_memory(compiled), "compiled": compiled}

    first = measure(start)
    answer = search_fit(start, measure, *capacity, mesh.shape["data"] * mesh.shape["fsdp"],
                        need=first["memory"], log=log)
    if answer.fits:
        if auto:
            log(f"train.grad_accum=auto -> 1 ({size(answer.need['total'])} of "
                f"{size(answer.capacity)})")
        return start, first["compiled"]
    if auto and answer.overrides and set(answer.overrides) == {"train.grad_accum"}:
        n = answer.overrides["train.grad_accum"]
        log(f"train.grad_accum=auto -> {n} ({size(answer.fit_bytes)} of "
            f"{size(answer.capacity)})")
        return apply_overrides(cfg, answer.overrides), answer.fit_result["compiled"]
    raise memory_fit.DoesNotFit(answer.line())
