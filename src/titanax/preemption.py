"""SIGTERM / SIGUSR1 -> "save at the next step boundary and stop" (launch.train exits 75).

Schedulers announce preemption with a signal and a grace period (SLURM: SIGTERM, or SIGUSR1
with `--signal=USR1@120`). Acting inside the handler is unsafe (a step may be mid-flight and
orbax is not reentrant), so the handler only records the signal and the loop polls
`stop_requested()` at logging, evaluation and checkpoint steps (train/loop.py), where the host
waits for the devices anyway. With several processes every one must stop at the same step
(each writes its shards of that step's checkpoint), so the flags are OR-ed across processes.

STOPPING is set as soon as this process knows the run is stopping: its own signal, the
agreement of `stop_requested()`, or another process's signal, which the signalled process
publishes in the coordination service's key-value store (a background thread cannot wait for
the next agreement: the main thread may be blocked waiting for that very thread). Work that
only protects the future yields to it: checkpoint checksums (checkpoint/integrity.py) stop
reading, so the exit waits for the save's commit and never for reading a committed step back
(under SLURM, `srun --wait` kills a process still reading after the others have exited, and the
job is not requeued).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

from titanax.distributed import coordination_client

# Ctrl-C (SIGINT) stops the same way: the work done so far is saved (launch.train exits 130).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: what train.sbatch requeues on
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
_STOP_KEY = "titanax/stopping"  # one training run per jax.distributed job
_POLL_S = 0.5  # how often is_set() asks the coordination service (from checksum threads)


class _StopFlag:
    """A threading.Event-like flag whose is_set() also learns of other processes' signals."""

    def __init__(self):
        self._local = threading.Event()
        self._watching = False  # others' signals count only while a PreemptionWatch is active
        self._next_poll = 0.0

    def set(self, *, publish: bool = False) -> None:
        self._local.set()
        if publish:
            try:
                client = coordination_client()
                if client is not None:
                    client.key_value_set(_STOP_KEY, "1", allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the step-boundary agreement still stops all
                pass

    def reset(self, *, watching: bool) -> None:
        self._local.clear()
        self._watching = watching

    def is_set(self) -> bool:
        if self._local.is_set():
            return True
        now = time.monotonic()
        if self._watching and now >= self._next_poll:
            self._next_poll = now + _POLL_S
            try:
                client = coordination_client()
                if client is not None and client.key_value_try_get(_STOP_KEY):
                    self._local.set()
            except Exception:  # noqa: BLE001 - not set yet (NOT_FOUND), or no service
                pass
        return self._local.is_set()


STOPPING = _StopFlag()


class PreemptionWatch:
    """Context manager; installs the handlers on entry and puts the old ones back on exit."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None  # the first signal's number
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionWatch:
        STOPPING.reset(watching=True)  # a run in this process (tests run several) starts afresh
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
        STOPPING.reset(watching=False)  # saves after the run (none in the loop) checksum again

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _on_signal(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signum
        elif signum == signal.SIGINT:  # Ctrl-C again: the user will not wait for the save
            print("error: interrupted again: stopping without saving; the newest committed "
                  "checkpoint is intact", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        STOPPING.set(publish=True)

    @property
    def exit_code(self) -> int:
        """What launch.train exits with after the save: 130 for Ctrl-C, else 75 (requeue)."""
        return EXIT_INTERRUPTED if self.received == signal.SIGINT else EXIT_PREEMPTED

    def stop_requested(self) -> bool:
        """True on every process once any process got a signal. Collective when there are
        several processes: all must call it at the same steps."""
        import jax

        local = self.received is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(local, np.int32))
        if np.any(flags):
            STOPPING.set()
        return bool(np.any(flags))

    def describe(self) -> str:
        if self.received is not None:
            return signal.Signals(self.received).name
        return "a stop signal sent to another process"


class StartupSignals:
    """From a launcher's first line until the training loop dispatches its first step (data,
    restore, memory check, compile: minutes for a large model): SIGTERM, SIGUSR1 and Ctrl-C
    end the command at once with one line, exit 75 (130 for Ctrl-C), so that a scheduler
    requeues the job. Nothing has been trained yet, so there is nothing to save, and what is
    written before the first step (config.json, data caches) is written whole or not at all.

    Python runs a signal handler only when the main thread returns to the interpreter, which
    a compile may not do for minutes; the signal's wakeup byte is read by a thread instead,
    which ends the process the moment it arrives."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.active = False
        self._previous: dict[int, object] = {}
        self._old_fd = -1
        self._pipe: tuple[int, int] | None = None

    def __enter__(self) -> StartupSignals:
        global _STARTUP
        if threading.current_thread() is not threading.main_thread():
            return self
        self._old_fd = self._start_watching()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, lambda *_: None)  # the thread acts
        self.active = True
        _STARTUP = self
        # A fork (process_guard: the guard forwards signals, its child trains) keeps the
        # handlers and the wakeup fd but not the thread: the child starts its own.
        os.register_at_fork(after_in_child=self._after_fork_in_child)
        return self

    def _start_watching(self) -> int:
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="titanax-startup-signals",
                         daemon=True).start()
        return old

    def _after_fork_in_child(self) -> None:
        if self.active and _STARTUP is self:
            self._start_watching()

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                os.close(r)
                return
            for signum in data:
                if self.active and signum in self.signals:
                    name = signal.Signals(signum).name
                    code = EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED
                    print(f"error: stopped by {name} during start-up, before the first step: "
                          "nothing trained yet, nothing to save; run the same command again "
                          f"to start (exit {code})", file=sys.stderr, flush=True)
                    os._exit(code)

    def __exit__(self, *exc) -> None:
        global _STARTUP
        self.active = False
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._old_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._pipe[1])  # the thread reads EOF and ends
        _STARTUP = None


_STARTUP: StartupSignals | None = None


def first_step_dispatched() -> None:
    """The training loop has compiled and dispatched its first step: from here a signal saves
    what was trained (PreemptionWatch) instead of ending the start-up at once."""
    if _STARTUP is not None:
        _STARTUP.active = False
