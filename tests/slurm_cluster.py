"""A real SLURM cluster of two nodes on this machine, for the tests and by hand.

munged, ``slurmctld`` and two ``slurmd`` (``-N n1``, ``-N n2``, each on its own port) run from Debian's
``slurm-wlm`` and ``munge`` packages (SLURM 22.05 on bookworm), with every file they keep (config, key,
state, spool, logs) in one directory of their own. The node names are not in DNS: slurm.conf gives each
``NodeAddr=127.0.0.1``. Scheduling is ``select/cons_tres`` with ``CR_CPU`` (two jobs may share a node),
processes are tracked through ``/proc`` (``proctrack/linuxproc``, no cgroups), no accounting, and
``JobRequeue=1``. Every daemon is stopped by the PID it was started with, never by name: other clusters and
other people's daemons may run beside these.

By hand (as root)::

    python tests/slurm_cluster.py start /tmp/mycluster   # prints the SLURM_CONF to export
    SLURM_CONF=/tmp/mycluster/slurm.conf sbatch ...
    python tests/slurm_cluster.py stop /tmp/mycluster     # cancels the jobs, stops the daemons

In the tests: the session fixture ``slurm_cluster`` (imported by conftest.py), which skips a test, with the
reason, where no cluster can start here (not root, the packages missing, a daemon that refuses).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # more than the machine's cores: two 2-node jobs fit side by side (config_overrides)
_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel", "srun")
_DAEMONS = ("munged", "slurmctld", *(f"slurmd-{node}" for node in NODES))
_STOP_WAIT_S = 15.0


class ClusterUnavailable(RuntimeError):
    """No cluster can run on this machine; the message says why."""


def _timeout_scale() -> float:
    try:
        from distsync.testing import timeout_scale

        return timeout_scale()
    except ImportError:
        return 1.0


def _free_port() -> int:
    """A port for a daemon: ``distsync.testing.free_port``'s, below the kernel's ephemeral range, which the
    machine's outgoing connections (the tests' worlds) cannot take before the daemon binds it; the kernel's
    pick (port 0) where distsync is not importable (this script run by hand elsewhere)."""
    try:
        from distsync.testing import free_port

        return free_port()
    except ImportError:
        pass
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def why_unavailable() -> str | None:
    """Why no cluster can start here, or None if one may."""
    if not sys.platform.startswith("linux"):
        return "a local SLURM cluster needs Linux"
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (slurmd runs each job as its user)"
    missing = [name for name in _PROGRAMS if shutil.which(name, path=_PATH) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    return None


_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


class SlurmCluster:
    """Two SLURM nodes on this machine, all of their files under ``root``.

    Args:
        root: the cluster's directory (created); its ``slurm.conf`` is what ``SLURM_CONF`` names
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": _PATH}
        for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
            self.env.pop(name, None)  # a test run inside an allocation talks to this cluster only

    # ------------------------------------------------------------------------------------------ life

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Write the config, start the daemons and wait until both nodes are idle; raise
        :class:`ClusterUnavailable` with the reason (and the daemons' last log lines) if they do not come up,
        after stopping whatever had started."""
        reason = why_unavailable()
        if reason:
            raise ClusterUnavailable(reason)
        for folder in ("munge", "state", "spool", "log", "pids"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._write_conf()
        try:
            self._spawn(
                "munged",
                [
                    "munged", "--foreground", "--force", f"--socket={self._munge_socket}",
                    f"--key-file={key}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                    f"--log-file={self.root / 'log' / 'munged.log'}",
                    f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                ],
            )  # fmt: skip
            self._wait(lambda: self._munge_socket.exists(), timeout, "munged did not open its socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            self._wait(self._controller_answers, timeout, "slurmctld does not answer")
            for node in NODES:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self._wait(self.nodes_idle, timeout * _timeout_scale(), "the nodes did not become idle")
        except ClusterUnavailable:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job, wait for their processes to end, stop the daemons by their PIDs."""
        if self._pid("slurmctld") is not None:
            self.scontrol("update", "PartitionName=debug", "State=DOWN", check=False)
            subprocess.run(["scancel", "--full", "--partition=debug"], env=self.env, capture_output=True)
            deadline = time.monotonic() + 45 * _timeout_scale()  # KillWait 30 s, then SIGKILL
            while self._jobs_alive() and time.monotonic() < deadline:
                time.sleep(0.5)
        for name in reversed(_DAEMONS):
            self._kill(name)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --------------------------------------------------------------------------------------- clients

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster."""
        proc = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("scontrol", *args, check=check)

    def sbatch(self, script: Path, *args: str, cwd: str | os.PathLike | None = None) -> str:
        """Submit ``script`` (``sbatch --parsable``) and return the job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *args, str(script)],
            env=self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {script}: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def number_next_job(self, job_id: int) -> None:
        """The next job submitted gets the id ``job_id`` (above every id so far: SLURM's ``FirstJobId``,
        which the controller takes on at ``scontrol reconfigure``), as two real jobs ``N`` and ``N + 10000``
        of a long-lived cluster have."""
        text = re.sub(r"(?m)^FirstJobId=.*\n", "", self.conf.read_text())
        self.conf.write_text(f"{text}FirstJobId={job_id}\n")
        self.scontrol("reconfigure")

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as ``scontrol show job`` lists them (``JobState``, ``NodeList``, ``Restarts``
        ...); ``{}`` once the controller has forgotten it."""
        proc = self.scontrol("show", "job", "--oneliner", job_id, check=False)
        if proc.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Poll the job until its state is one of ``states``; raise ``TimeoutError`` naming the state
        it stays in. ``timeout`` is an idle machine's, scaled with the load."""
        deadline = time.monotonic() + timeout * _timeout_scale()
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} is {fields.get('JobState')}, not {'/'.join(states)}\n{self.state_report()}"
                )
            time.sleep(0.25)

    def state_report(self, log_lines: int = 25) -> str:
        """What the controller and the nodes say now (every job, every node, the daemons' last log lines):
        the text a test attaches to a timeout, as the cluster's files go with the session's end."""
        parts = []
        for args in (
            ("scontrol", "show", "job", "--details"),
            ("scontrol", "show", "node"),
            ("sinfo", "-N", "-l"),
        ):
            try:
                proc = self.run(*args, check=False, timeout=30)
                parts.append(f"$ {' '.join(args)}\n{proc.stdout.strip()}{proc.stderr.strip()}")
            except subprocess.TimeoutExpired:
                parts.append(f"$ {' '.join(args)}: no answer in 30 s")
        parts.append(f"$ uptime: load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        parts.append(self._log_tails(log_lines))
        return "\n".join(parts)

    def job_processes(self) -> list[int]:
        """The processes of every job step on this cluster's nodes (``scontrol listpids`` on each node)."""
        pids = []
        for node in NODES:
            proc = subprocess.run(
                ["scontrol", "listpids"],
                env={**self.env, "SLURMD_NODENAME": node},
                capture_output=True,
                text=True,
                timeout=30,
            )
            pids += [int(line.split()[0]) for line in proc.stdout.splitlines() if line[:1].isdigit()]
        return pids

    # ----------------------------------------------------------------------------------------- inside

    @property
    def _munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={host} Port={_free_port()} "
            f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN"
            for node in NODES
        )
        self.conf.write_text(
            f"""# written by tests/slurm_cluster.py: a two-node cluster on this machine
ClusterName=distsync
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self._munge_socket}
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}/%n
SlurmctldPidFile={self.root / "pids"}/slurmctld.pid
SlurmdPidFile={self.root / "pids"}/slurmd-%n.pid
SlurmctldLogFile={self.root / "log"}/slurmctld.log
SlurmdLogFile={self.root / "log"}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("ab")
        proc = subprocess.Popen(
            args,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C of the developer's shell does not reach it
        )
        log.close()
        (self.root / "pids" / f"{name}.started").write_text(str(proc.pid))
        self._started = getattr(self, "_started", {})
        self._started[name] = proc

    def _pid(self, name: str) -> int | None:
        """The daemon's PID while it runs (a PID reused by another program since is not it)."""
        try:
            pid = int((self.root / "pids" / f"{name}.started").read_text())
        except (OSError, ValueError):
            return None
        program = name.split("-")[0]
        return pid if _alive(pid) and _command(pid).split(" ")[0].endswith(program) else None

    def _kill(self, name: str) -> None:
        pid = self._pid(name)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + _STOP_WAIT_S
            while _alive(pid) and time.monotonic() < deadline:
                self._reap(name)
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._reap(name, block=True)
        (self.root / "pids" / f"{name}.started").unlink(missing_ok=True)

    def _reap(self, name: str, block: bool = False) -> None:
        proc = getattr(self, "_started", {}).get(name)
        if proc is not None:
            if block:
                proc.wait(timeout=_STOP_WAIT_S)
            else:
                proc.poll()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, proc in getattr(self, "_started", {}).items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0]} exited" if dead else what
                raise ClusterUnavailable(f"the local SLURM cluster did not start: {why}\n{self._log_tails()}")
            time.sleep(0.2)

    def _log_tails(self, lines_each: int = 5) -> str:
        tails = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").strip().splitlines()[-lines_each:]
            if lines:
                tails.append(f"{path.name}:\n  " + "\n  ".join(lines))
        return "\n".join(tails)

    def _controller_answers(self) -> bool:
        return self.run("scontrol", "ping", check=False, timeout=30).stdout.count("UP") > 0

    def nodes_idle(self) -> bool:
        """Every node idle: no job on it, none completing (a job's end is done on the nodes too)."""
        proc = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False, timeout=30)
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in NODES)

    def _jobs_alive(self) -> bool:
        proc = self.run("squeue", "--noheader", "--format=%i", check=False, timeout=30)
        return bool(proc.stdout.strip()) or bool(self.job_processes())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A two-node SLURM cluster for the session (its files in a temporary directory), or the test is
    skipped with the reason none can start here."""
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="distsync-slurm-")
    cluster = SlurmCluster(root)
    try:
        cluster.start()
    except ClusterUnavailable as error:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(str(error))
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("start", "stop"):
        print(f"usage: {argv[0]} start|stop DIRECTORY", file=sys.stderr)
        return 2
    cluster = SlurmCluster(argv[2])
    if argv[1] == "stop":
        cluster.stop()
        print(f"stopped the cluster of {cluster.conf}")
        return 0
    try:
        cluster.start()
    except ClusterUnavailable as error:
        print(error, file=sys.stderr)
        return 1
    print(f"two nodes (n1, n2) are up; export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
