"""Runs a multi-process training process as a child of a small guard, so that losing another
process ends this one with a clear error instead of a C++ abort trace (or a hang).

When a peer dies, the coordination service reports it to every survivor, and XLA terminates
the survivor from a C++ thread (SIGABRT) with no hook for Python. The guard forks before jax
is imported, copies the child's stderr through (keeping a tail), and when the child dies that
way prints one line naming the lost process, then exits 1. Signals the guard receives
(SIGTERM/SIGUSR1 preemption notices, Ctrl-C) are passed on to the child; if the guard itself
is killed, the kernel kills the child too (PR_SET_PDEATHSIG), so no orphan keeps a GPU.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import threading

EXIT_LOST_PROCESS = 1
_FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
_TAIL_BYTES = 64 * 1024


def describe_lost_process(log_tail: str) -> str | None:
    """Which process the coordination service reported lost, from the child's last stderr;
    None when the child died for another reason."""
    m = (re.search(r"following tasks are unhealthy[^:]*:\s*([\d,\s]+)", log_tail)
         or re.search(r"[Tt]ask (\d+) heartbeat timeout", log_tail))
    if m:
        ids = sorted({int(x) for x in re.findall(r"\d+", m.group(1))})
        return ", ".join(f"process {i}" for i in ids) + " (stopped sending heartbeats)"
    if "leader task was preempted/died" in log_tail or (
            "Failed to send RPC to coordination service" in log_tail):
        return "process 0, the coordinator (its coordination service is unreachable)"
    if "JAX distributed service detected fatal errors" in log_tail:
        return "another process"
    return None


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child may outlive a killed guard
        pass


# What a process prints as it dies of a lost peer: a Python traceback (a collective that
# failed at once), then, once the peer's heartbeats have timed out, XLA's E/F log lines and its
# abort trace. Such lines are held back for a while (longer than the heartbeat timeout): if
# the process dies of a lost peer meanwhile, the guard's one line replaces them; if not, they
# are printed (late by at most that long), as is everything when it dies another way.
_SUSPECT = re.compile(rb"^(Traceback \(most recent call last\)|[EF]\d{4} \d\d:\d\d:\d\d)")


class _Copier:
    """Copies the child's stderr through, keeping a tail and holding back suspect lines."""

    def __init__(self, read_fd: int, hold_s: float):
        self.read_fd = read_fd
        self.hold_s = hold_s
        self.tail = bytearray()
        self.held: list[bytes] = []
        self.held_since: float | None = None
        self.lock = threading.Lock()
        self.out = sys.stderr.buffer
        self._line = b""

    def run(self) -> None:
        import select
        import time

        while True:
            ready, _, _ = select.select([self.read_fd], [], [], 1.0)
            with self.lock:
                if self.held_since is not None and time.monotonic() - self.held_since > self.hold_s:
                    self.flush_held()
            if not ready:
                continue
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                with self.lock:
                    if self._line:
                        self._emit(self._line)
                        self._line = b""
                return
            with self.lock:
                self.tail.extend(chunk)
                del self.tail[:-_TAIL_BYTES]
                data = self._line + chunk
                *lines, self._line = data.split(b"\n")
                for line in lines:
                    self._emit(line + b"\n")
                if self._line and self.held_since is None and b"\r" in self._line:
                    self.out.write(self._line)  # a progress bar redrawing its line
                    self._line = b""
                self.out.flush()

    def _emit(self, line: bytes) -> None:
        import time

        if self.held_since is None and _SUSPECT.match(line):
            self.held_since = time.monotonic()
        if self.held_since is not None:
            self.held.append(line)
        else:
            self.out.write(line)

    def flush_held(self) -> None:
        self.out.write(b"".join(self.held))
        self.out.flush()
        self.held, self.held_since = [], None

    def drop_held(self) -> None:
        self.held, self.held_since = [], None


def guard(process_id: int, num_processes: int, *, hold_s: float = 90.0) -> None:
    """Returns in the child, which goes on to train; the guard (parent) never returns.
    hold_s: how long suspect lines wait for a verdict (above the heartbeat timeout)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _die_with_parent()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        return
    os.close(write_fd)
    # The guard only forwards: its child says what a signal during start-up means.
    from titanax.preemption import first_step_dispatched

    first_step_dispatched()
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    copier = _Copier(read_fd, hold_s)
    thread = threading.Thread(target=copier.run, daemon=True)
    thread.start()
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    thread.join(timeout=5)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    with copier.lock:
        # (XLA ends a process whose peer was lost from a C++ thread: it dies of SIGABRT)
        lost = (None if code is not None else
                describe_lost_process(copier.tail.decode(errors="replace")))
        if lost is None:
            copier.flush_held()
        else:  # what it printed while dying of it says less than the line below
            copier.drop_held()
    if code is not None:
        os._exit(code)
    if lost is not None:
        sys.stderr.write(
            f"error: lost {lost}; process {process_id} of {num_processes} stopped too. Check "
            "the lost process's log and the scheduler's events; rerunning (or requeueing) the "
            "job resumes from the last checkpoint.\n")
        sys.stderr.flush()
        os._exit(EXIT_LOST_PROCESS)
    sig = os.WTERMSIG(status)
    sys.stderr.write(f"error: process {process_id} died from signal "
                     f"{signal.Signals(sig).name}\n")
    sys.stderr.flush()
    os._exit(128 + sig)
