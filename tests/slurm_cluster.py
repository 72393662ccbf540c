"""A real, local SLURM cluster for tests: munged, slurmctld and one slurmd per emulated node,
all on this machine, with their own config, keys, state and logs under one folder.

    with LocalSlurmCluster(tmp_path / "slurm") as cluster:
        job = cluster.sbatch(["-N", "2", "job.sbatch"], wait=True)
        cluster.job(job)["JobState"]  # "COMPLETED"

Nodes n1, n2, ... all have NodeAddr 127.0.0.1 and their own slurmd port (`slurmd -N n1`);
their names resolve through /etc/hosts (a line is added once when they do not), since jobs
address each other by node name (jax's coordinator is the first node of the step). Daemons
run as root in the foreground of child processes and are stopped by pid; so are any job
processes left behind (found by their SLURM_CONF). Needs root and Debian's slurmctld, slurmd,
slurm-client and munge packages; `unavailable()` says why not, for a skip message.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo",
            "srun")
HOSTS_FILE = pathlib.Path("/etc/hosts")
HOSTS_MARK = "# titanax test SLURM nodes"


def unavailable(node_names=("n1", "n2")) -> str | None:
    """Why a local cluster cannot run here, or None when it can."""
    missing = [b for b in BINARIES if shutil.which(b) is None
               and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return (f"SLURM is not installed (no {', '.join(missing)}); `bash scripts/dev.sh test` "
                "installs Debian's slurmctld slurmd slurm-client munge when run as root with apt")
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (slurmd starts jobs as their user)"
    unresolved = [n for n in node_names if not _resolves(n)]
    if unresolved and not os.access(HOSTS_FILE, os.W_OK):
        return (f"node names {unresolved} do not resolve and {HOSTS_FILE} is not writable; add "
                f"'127.0.0.1 {' '.join(node_names)}' to it")
    return None


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


def _ensure_hosts(node_names) -> None:
    unresolved = [n for n in node_names if not _resolves(n)]
    if unresolved:
        with HOSTS_FILE.open("a") as f:
            f.write(f"\n127.0.0.1 {' '.join(unresolved)} {HOSTS_MARK}\n")


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmError(RuntimeError):
    pass


class LocalSlurmCluster:
    def __init__(self, root: pathlib.Path | str, nodes=("n1", "n2"), cpus_per_node: int = 2,
                 cred_expire_s: int = 10):
        self.root = pathlib.Path(root).resolve()
        self.nodes = tuple(nodes)
        self.cpus = cpus_per_node
        self.cred_expire_s = cred_expire_s  # also how long a requeued job waits to start again
        self.conf = self.root / "etc" / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        self.env["SLURM_CONF"] = str(self.conf)

    # --- set-up -------------------------------------------------------------------------------

    def _write_config(self) -> None:
        r = self.root
        for d in ("etc", "state", "log", "run", "spool"):
            (r / d).mkdir(parents=True, exist_ok=True)
        # munged insists that its key and socket folders are not writable by others.
        for d in ("munge-key", "munge-run", "munge-log"):
            (r / d).mkdir(mode=0o755, exist_ok=True)
            os.chmod(r / d, 0o755)
        os.chmod(r, 0o755)
        key = r / "munge-key" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
            os.chmod(key, 0o600)
        ctld_port, slurmd_port, *node_ports = _free_ports(2 + len(self.nodes))
        self.munge_socket = r / "munge-run" / "munge.socket"
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=titanaxtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # Our own munged; cred_expire is also the delay before a requeued job may start.
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire_s}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups (containers, CI): processes tracked by parent pid, no task binding.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SelectType=select/linear",
            "SchedulerType=sched/backfill",
            # Schedule every 2 s (default 60 s), so a requeued job starts as soon as it may.
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "SlurmdParameters=config_overrides",  # trust the node lines, not the hardware
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=30",
            # sbatch --wait polls after 2 s, then 8 and 32 s while under MinJobAge/2: 5 keeps it
            # at 2 s. Finished jobs are forgotten some seconds later (job() then says GONE).
            "MinJobAge=5",
            "InactiveLimit=0",
            "MailProg=/bin/true",
            # Job ids (and so jax's SLURM-derived coordinator ports) differ between clusters.
            f"FirstJobId={1000 + int.from_bytes(os.urandom(2), 'little') % 50000}",
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={port} "
                         f"CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        for name in self.nodes:
            (r / "spool" / name).mkdir(exist_ok=True)

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env,
                                            start_new_session=True)
        out.close()

    def start(self, timeout_s: float = 60) -> LocalSlurmCluster:
        _ensure_hosts(self.nodes)
        self._write_config()
        r = self.root
        self._spawn("munged", [_sbin("munged"), "--foreground", "--force",
                               f"--socket={self.munge_socket}",
                               f"--key-file={r / 'munge-key' / 'munge.key'}",
                               f"--log-file={r / 'munge-log' / 'munged.log'}",
                               f"--pid-file={r / 'munge-run' / 'munged.pid'}",
                               f"--seed-file={r / 'munge-run' / 'munged.seed'}"])
        self._wait_for(lambda: self.munge_socket.exists(), timeout_s, "munged's socket")
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-i"])
        self._wait_for(lambda: self._run(["sinfo", "-h"], check=False).returncode == 0,
                       timeout_s, "slurmctld to answer")
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", [_sbin("slurmd"), "-D", "-N", name])
        self._wait_for(self._nodes_idle, timeout_s, f"nodes {self.nodes} to be idle")
        return self

    def _nodes_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait_for(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise SlurmError(f"{', '.join(dead)} exited while waiting for {what}\n"
                                 + self.logs())
            if ok():
                return
            time.sleep(0.5)
        raise SlurmError(f"timed out after {timeout_s:.0f} s waiting for {what}\n" + self.logs())

    def logs(self, tail: int = 30) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")) + [self.root / "munge-log" / "munged.log"]:
            if f.is_file():
                lines = f.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {f.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(parts)

    # --- use ----------------------------------------------------------------------------------

    def _run(self, argv: list[str], check: bool = True, env=None, timeout: float | None = 60,
             cwd=None):
        p = subprocess.run(argv, env=env or self.env, capture_output=True, text=True,
                           timeout=timeout, cwd=cwd)
        if check and p.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
        return p

    def job_env(self, **extra: str) -> dict[str, str]:
        env = dict(self.env)
        env.update(extra)
        return env

    def sbatch(self, argv: list[str], *, env=None, wait: bool = False, cwd=None,
               timeout_s: float = 600) -> tuple[int, int]:
        """Submits from `cwd`; returns (job id, sbatch's exit code: the job's with --wait)."""
        args = ["sbatch", "--parsable"] + (["--wait"] if wait else []) + argv
        p = self._run(args, check=False, env=env, timeout=timeout_s, cwd=cwd)
        m = re.match(r"\s*(\d+)", p.stdout)
        if not m:
            raise SlurmError(f"sbatch printed no job id ({p.returncode}): {p.stderr.strip()}\n"
                             + self.logs())
        return int(m.group(1)), p.returncode

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        p = self._run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if p.returncode != 0 and "Invalid job id" in p.stderr:
            return {"JobId": str(job_id), "JobState": "GONE", "Restarts": "?"}
        if p.returncode != 0:
            raise SlurmError(f"scontrol show job {job_id} failed: {p.stderr.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", p.stdout))

    def wait_job(self, job_id: int, done, timeout_s: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        info = self.job(job_id)
        while info["JobState"] == "GONE" or not done(info):
            if info["JobState"] == "GONE":
                raise SlurmError(f"job {job_id} ended and was forgotten (MinJobAge) before it "
                                 f"was seen to {what}\n" + self.logs())
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout_s:.0f} s waiting for job {job_id} "
                                 f"to {what}; it is {info.get('JobState')}\n" + self.logs())
            time.sleep(1)
            info = self.job(job_id)
        return info

    def signal_steps(self, job_id: int, sig: str) -> None:
        """Sends `sig` to every task of the job's steps (not the batch shell), as SLURM's
        --signal=SIG@T does before the time limit."""
        self._run(["scancel", f"--signal={sig}", str(job_id)])

    # --- tear-down ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancels jobs, stops the daemons by pid, then kills any job process left behind."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self._run(["scancel", "--full", "--signal=KILL", "--user=root"], check=False)
            self._run(["scancel", "--user=root"], check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if not self._run(["squeue", "-h"], check=False).stdout.strip():
                    break
                time.sleep(0.5)
        for name in [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftover_pids(self) -> list[int]:
        """Processes started for this cluster still alive: slurmstepd and job tasks, which
        carry our SLURM_CONF in their environment."""
        mark = f"SLURM_CONF={self.conf}".encode()
        ours = {os.getpid()}
        pids = []
        for d in pathlib.Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) in ours:
                continue
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if mark in env:
                pids.append(int(d.name))
        return pids

    def __enter__(self) -> LocalSlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # a cluster to try things by hand: python tests/slurm_cluster.py DIR
    import sys

    why = unavailable()
    if why:
        sys.exit(f"cannot start a local SLURM cluster: {why}")
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/titanax-slurm")
    with LocalSlurmCluster(root) as cluster:
        print(f"SLURM cluster up (nodes {', '.join(cluster.nodes)}); in another shell:\n"
              f"  export SLURM_CONF={cluster.conf}\n  sinfo; sbatch ...\n"
              "Ctrl-C stops it (jobs, daemons and job processes).", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
