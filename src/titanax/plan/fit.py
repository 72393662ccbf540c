"""The smallest change that makes a train step fit its devices' memory, among the changes that
leave the run's result as it is: train.grad_accum (the step's gradient is still the mean over
the same global batch), execution.remat (the same math, recomputed or moved to host memory) and,
for a run that already keeps its optimizer in host memory, train.offload_params (the master
weights join it there). Layout and batch changes, and host offload for a run that asked for
none, are launch.plan --search's business.

launch.train calls `fit_to_devices` before its first step (compiling on the real mesh);
launch.plan runs `search_fit` inside its deviceless compile (compile.py) and prints the answer
as the line to copy. train.grad_accum=auto takes the answer itself, whatever it changes (it
logs what). Both measure candidates by compiling them, smallest change first: grad_accum up
the divisors of the per-device batch, then each remat policy that saves more than the
configured one (search.REMATS order), with grad_accum from the configured up, then the master
weights in host memory. Within one such group the memory falls as grad_accum grows (smaller
microbatches, one gradient sum), so the group's largest count is compiled first: when even
that does not fit the group is skipped, else a bisection finds its smallest count that fits
(70B on 8 H100s with the optimizer offloaded: 6 compiles where the whole ladder took 16).
On a GPU each group is also compiled with the layer loop single-buffered
(execution.loop_double_buffering=false: the same math, less memory, the next layer's weight
all-gather less hidden) at the counts below the group's answer; when one fits, the cost model's
faster of the two is taken and the line says which and why (docs/planner.md, "The layer
loop's double buffering").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from titanax.config import Config, ConfigError, apply_overrides, grad_accum_in_place_unsupported
from titanax.config.parallel import batch_ways
from titanax.plan.search import REMATS
from titanax.train import memory_fit

GB = 1e9


def size(n: float) -> str:
    """Bytes as the planner prints them (GB = 1e9); MB for the small models of tests."""
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


# measure(cfg) -> {'memory': memory_fit.compiled_memory(...), ...}; raises if it cannot compile
Measure = Callable[[Config], dict]
# predict(cfg) -> the cost model's step seconds (plan/cost_model.py), to choose between changes
Predict = Callable[[Config], float]
# The layer loop's buffering (xla_flags.compiler_options): double-buffered by default
DOUBLE_BUFFERING = "execution.loop_double_buffering"


@dataclasses.dataclass
class FitAnswer:
    need: dict[str, int]        # the memory of the config as given (compiled_memory)
    capacity: int               # bytes per device it must fit in
    where: str                  # where the capacity comes from, for the message
    overrides: dict | None = None  # the smallest change that fits; None: none found
    fit_bytes: int = 0          # its memory per device
    fit_result: dict | None = None  # measure()'s answer for it
    tried: list[dict] = dataclasses.field(default_factory=list)
    # Why this change over the layer loop's other buffering (one sentence), when both fit
    why: str = ""

    @property
    def fits(self) -> bool:
        return self.need["total"] <= self.capacity

    def set_flags(self) -> str:
        return " ".join(f"--set {k}={_value(v)}" for k, v in (self.overrides or {}).items())

    def head(self) -> str:
        return (f"the train step needs {size(self.need['total'])} per device of "
                f"{size(self.capacity)} ({self.where})")

    def line(self) -> str:
        """One line: fits, or what it needs of what, and the --set that fits (or why none)."""
        head = self.head()
        if self.fits:
            return f"{head}: fits"
        if self.overrides:
            why = f": {self.why}" if self.why else ""
            return f"{head}; {self.set_flags()} fits ({size(self.fit_bytes)}){why}"
        state = state_bytes(self.need)
        if state >= self.capacity:
            why = (f"{size(state)} of it is the train state and batch, which no "
                   "train.grad_accum or execution.remat shrinks")
        else:
            why = f"no train.grad_accum or execution.remat setting fits ({len(self.tried)} compiled)"
        return (f"{head}; {why}: see python -m launch.plan --search for host offload "
                "(train.offload_optimizer), other layouts (mesh.context splits long "
                "sequences), or more GPUs")


def _value(v) -> str:
    """A setting's value as --set takes it (booleans lowercase)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def auto_choice(overrides: dict, memory: str, why: str = "") -> str:
    """The line train.grad_accum=auto logs for the change it takes, e.g.
    'train.grad_accum=auto -> 16, with execution.remat=full train.offload_params=true (70.6 GB of
    76.0 GB)': the other settings it changed are named, so the log says what runs."""
    others = " ".join(f"{k}={_value(v)}" for k, v in overrides.items()
                      if k != "train.grad_accum")
    return (f"train.grad_accum=auto -> {overrides['train.grad_accum']}"
            f"{', with ' + others if others else ''} ({memory}){': ' + why if why else ''}")


def state_bytes(memory: dict[str, int]) -> int:
    """What every candidate still needs: the arguments (state, batch) and new outputs."""
    return memory["arguments"] + memory["outputs"] - memory["aliased"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_groups(cfg: Config, batch_ways: int) -> Iterator[tuple[dict, list[int]]]:
    """(overrides, grad_accum ladder), smallest change first: each group's candidates are its
    overrides with train.grad_accum set to each count of its ladder, ascending. batch_ways:
    how many ways the rows split (config/parallel.py batch_ways, resolved)."""
    micro = cfg.pipeline.microbatches if cfg.mesh.pipeline > 1 else 1
    per_device = cfg.train.batch_size // (batch_ways * micro)
    start = cfg.train.known_grad_accum
    ladder = [k for k in _divisors(max(per_device, 1)) if k >= start]
    if ladder[1:]:
        yield {}, ladder[1:]
    remat = "dots" if cfg.execution.remat == "dots_no_batch" else cfg.execution.remat
    for policy in REMATS[REMATS.index(remat) + 1:]:
        yield {"execution.remat": policy}, ladder
    # The optimizer already in host memory: the layers' fp32 master weights may follow it (the
    # same math and result; each microbatch reads them over the host link, which the plan
    # prices). With several microbatches that needs the sum in place: full or full_offload.
    t = cfg.train
    if t.offload_optimizer and not t.offload_params and cfg.mesh.pipeline <= 1:
        for policy in REMATS[max(REMATS.index(remat), REMATS.index("full")):]:
            yield {"train.offload_params": True, "execution.remat": policy}, ladder


def candidates(cfg: Config, batch_ways: int) -> Iterator[dict]:
    """Every candidate of candidate_groups, in order."""
    for overrides, ladder in candidate_groups(cfg, batch_ways):
        for k in ladder:
            yield {**overrides, "train.grad_accum": k}


def search_fit(cfg: Config, measure: Measure, capacity: int, where: str, batch_ways: int,
               *, need: dict | None = None, log=None, predict: Predict | None = None,
               loop_buffering: bool = False) -> FitAnswer:
    """cfg's memory (measured, or `need` when known) against capacity; when it does not fit,
    the first group of candidate_groups with a count that fits, at its smallest such count
    (the group's largest count compiled first, then a bisection: module docstring).
    loop_buffering (a GPU compile, where execution.loop_double_buffering means something):
    each group is also tried with the layer loop single-buffered at the counts below the
    double-buffered answer (from the configured count up); when one fits, `predict`'s faster
    of the two is the answer (without predict, the double-buffered), and answer.why says
    which and why. Candidates the config rejects are skipped; one that fails to compile is
    recorded and skipped. Nothing is searched when the state alone is too big."""
    say = log or (lambda *_a: None)
    need = need if need is not None else measure(cfg)["memory"]
    answer = FitAnswer(need, capacity, where)
    if answer.fits or state_bytes(need) >= capacity:
        return answer
    say(f"memory check: {answer.head()}; compiling the smallest changes that could fit")
    results: dict[tuple, dict | None] = {}  # a tried candidate -> its result (None: failed)

    def fits(overrides: dict) -> bool | None:
        """Compile overrides (once): True / False, or None when the config refuses it or it
        does not compile (recorded in answer.tried)."""
        key = tuple(overrides.items())
        if key not in results:
            results[key] = _try(cfg, overrides, measure, answer, say)
        r = results[key]
        return None if r is None else r["memory"]["total"] <= capacity

    def smallest(group: list[dict]) -> dict | None:
        """The group's candidate with the fewest microbatches that fits (None: none does)."""
        if not group:
            return None
        # The most microbatches first: the group's least memory. (Only the plain sum may need
        # less at 1 than at 2, having no running sum there: then 1 is tried on its own.)
        plain_one = (group[0]["train.grad_accum"] == 1 and len(group) > 1
                     and _sums_plainly(cfg, group[1]))
        if plain_one and fits(group[0]):
            return group[0]
        if not fits(group[-1]):
            return None
        lo, hi = 1 if plain_one else 0, len(group) - 1
        while lo < hi:  # the smallest index that fits; group[hi] fits
            mid = (lo + hi) // 2
            if fits(group[mid]):
                hi = mid
            else:
                lo = mid + 1
        return group[hi]

    single = loop_buffering and cfg.execution.loop_double_buffering
    start = cfg.train.known_grad_accum
    for overrides, ladder in candidate_groups(cfg, batch_ways):
        found = smallest([{**overrides, "train.grad_accum": k} for k in ladder])
        alt = None
        if single:  # the loop single-buffered, at fewer microbatches than found needs
            below = [k for k in sorted({start, *ladder})
                     if found is None or k < found["train.grad_accum"]]
            alt = smallest([{**overrides, DOUBLE_BUFFERING: False, "train.grad_accum": k}
                            for k in below])
        chosen = found or alt
        if found and alt:
            chosen, answer.why = _faster(cfg, found, alt, predict)
        elif found and single and (k := found["train.grad_accum"]) > min(below or [k]):
            closest = {**overrides, DOUBLE_BUFFERING: False, "train.grad_accum": max(below)}
            r = results.get(tuple(closest.items()))
            answer.why = (f"the layer loop single-buffered at grad_accum {max(below)} does not "
                          f"fit either" + (f" ({size(r['memory']['total'])})" if r else ""))
        if chosen is None:
            continue
        result = results[tuple(chosen.items())]
        answer.overrides, answer.fit_bytes = chosen, result["memory"]["total"]
        answer.fit_result = result
        break
    return answer


def _faster(cfg: Config, double: dict, single: dict, predict: Predict | None
            ) -> tuple[dict, str]:
    """(the faster of the double-buffered change and the single-buffered one with fewer
    microbatches, one sentence saying which and why) by the cost model's step time."""
    k2, k1 = double["train.grad_accum"], single["train.grad_accum"]
    if predict is None:
        return double, (f"grad_accum {k1} with the layer loop single-buffered fits too "
                        "(not compared: no cost model here)")
    try:
        t2 = predict(apply_overrides(cfg, double))
        t1 = predict(apply_overrides(cfg, single))
    except (ConfigError, ValueError, KeyError) as e:  # a layout the cost model cannot price
        return double, (f"grad_accum {k1} with the layer loop single-buffered fits too (not "
                        f"compared: {str(e).splitlines()[0][:120]})")
    if t1 < t2:
        return single, (f"the layer loop single-buffered at grad_accum {k1} ({t1:.2f} s a "
                        f"step by the cost model: the weight all-gathers it no longer hides) "
                        f"beats double-buffered at grad_accum {k2} ({t2:.2f} s)")
    return double, (f"double-buffered at grad_accum {k2} ({t2:.2f} s a step by the cost "
                    f"model) beats the layer loop single-buffered at grad_accum {k1} "
                    f"({t1:.2f} s: its weight all-gathers are no longer hidden)")


def _sums_plainly(cfg: Config, overrides: dict) -> bool:
    """Does cfg with overrides (grad_accum > 1) sum its microbatches the plain way?"""
    try:
        return grad_accum_in_place_unsupported(apply_overrides(cfg, overrides)) is not None
    except ConfigError:
        return True


def _try(cfg: Config, overrides: dict, measure: Measure, answer: FitAnswer, say):
    """measure(cfg with overrides), recorded in answer.tried; None when the config refuses the
    change or the step does not compile."""
    try:
        c_cfg = apply_overrides(cfg, overrides)
    except ConfigError:
        return None
    label = " ".join(f"{k}={_value(v)}" for k, v in overrides.items())
    try:
        result = measure(c_cfg)
    except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped
        answer.tried.append({"overrides": overrides, "error": str(e).splitlines()[0][:300]})
        say(f"  {label}: does not compile ({type(e).__name__})")
        return None
    total = result["memory"]["total"]
    answer.tried.append({"overrides": overrides, "bytes": total})
    say(f"  {label}: {size(total)}")
    return result


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
    on_gpu = mesh.devices.flat[0].platform == "gpu"  # where the loop's buffering is an option
    answer = search_fit(start, measure, *capacity, batch_ways(mesh.shape),
                        need=first["memory"], log=log, predict=_predictor(mesh),
                        loop_buffering=on_gpu)
    if answer.fits:
        if auto:
            log(f"train.grad_accum=auto -> 1 ({size(answer.need['total'])} of "
                f"{size(answer.capacity)})")
        return start, first["compiled"]
    if auto and answer.overrides:
        log(auto_choice(answer.overrides, f"{size(answer.fit_bytes)} of {size(answer.capacity)}",
                        answer.why))
        return apply_overrides(cfg, answer.overrides), answer.fit_result["compiled"]
    raise memory_fit.DoesNotFit(answer.line())


def _predictor(mesh) -> Predict | None:
    """The cost model's step time on mesh's devices (plan/cost_model.py), or None when the
    hardware table does not know them (a CPU)."""
    from titanax.hardware import HARDWARE, lookup_device
    from titanax.plan.cluster import Cluster, layout_for
    from titanax.plan.cost_model import estimate

    hw = lookup_device(mesh.devices.flat[0].device_kind)
    if hw is None:
        return None
    kind = next(k for k, v in HARDWARE.items() if v is hw)
    n = mesh.devices.size
    per_node = min(n, hw.gpus_per_node)
    cluster = Cluster(kind, max(n // per_node, 1), per_node)
    return lambda c: estimate(c, cluster, layout_for(c, cluster)).step_s
