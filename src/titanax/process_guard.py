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


def _copy_stderr(read_fd: int, tail: bytearray) -> None:
    out = sys.stderr.buffer
    while chunk := os.read(read_fd, 65536):
        out.write(chunk)
        out.flush()
        tail.extend(chunk)
        del tail[:-_TAIL_BYTES]


def guard(process_id: int, num_processes: int) -> None:
    """Returns in the child, which goes on to train; the guard (parent) never returns."""
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
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    tail = bytearray()
    copier = threading.Thread(target=_copy_stderr, args=(read_fd, tail), daemon=True)
    copier.start()
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    copier.join(timeout=5)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    lost = describe_lost_process(tail.decode(errors="replace"))
    if lost is not None:
        sys.stderr.write(
            f"error: lost {lost}; process {process_id} of {num_processes} stopped too. Check "
            "the lost process's log and the scheduler's events; rerunning (or requeueing) the "
            "job resumes from the last checkpoint.\n")
        sys.stderr.flush()
        os._exit(EXIT_LOST_PROCESS)
    sys.stderr.write(f"error: process {process_id} died from signal "
                     f"{signal.Signals(sig).name}\n")
    sys.stderr.flush()
    os._exit(128 + sig)
