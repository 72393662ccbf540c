"""SIGTERM / SIGUSR1 -> "save at the next step boundary and exit 0".

Schedulers announce preemption with a signal and a grace period (SLURM: SIGTERM, or SIGUSR1
with `--signal=USR1@120`). Acting inside the handler is unsafe (a step may be mid-flight and
orbax is not reentrant), so the handler only records the signal and the loop polls
`stop_requested()` between steps. With several processes every one must stop at the same step
(each writes its shards of that step's checkpoint), so the flags are OR-ed across processes.
"""

from __future__ import annotations

import signal
import threading

import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """Context manager; installs the handlers on entry and puts the old ones back on exit."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None  # the first signal's number
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "PreemptionWatch":
        # Python delivers signals to the main thread only; a loop running in another thread
        # (a notebook worker, a test harness) keeps the default behaviour.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _on_signal(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signum

    def stop_requested(self) -> bool:
        """True on every process once any process got a signal. Collective when there are
        several processes: all must call it at the same steps."""
        import jax

        local = self.received is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(local, np.int32))
        return bool(np.any(flags))

    def describe(self) -> str:
        if self.received is not None:
            return signal.Signals(self.received).name
        return "a stop signal sent to another process"
