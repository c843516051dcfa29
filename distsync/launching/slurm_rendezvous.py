"""Where the nodes of a SLURM job meet: its first node, on a port of the job's own that no other run holds.

The endpoint follows from the job (:func:`slurm_rendezvous`): the first node of the allocation (its address
as SLURM knows it, where its name does not resolve), on the first port of the job's own sequence
(:func:`slurm_ports`) where a store of the job's run answers (:func:`claimed_slurm_store`). The job's first
task serves it, on the first of those ports it can bind that no other run holds; every other agent walks the
same ports, again and again, until it finds the store that carries its run (the run id in the store:
:func:`~distsync.launching.rendezvous.claimed_store`). Two jobs whose first node and first port are the same
(ids equal modulo the range), or a port another program holds, cost a port further along; a job requeued
keeps its id, its ports and its run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from distsync.launching.rendezvous import OWNER_KEY, RendezvousError, on_this_machine

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = [
    "SlurmRendezvous",
    "claimed_slurm_store",
    "slurm_port",
    "slurm_ports",
    "slurm_rendezvous",
    "slurm_run_id",
]

SLURM_PORTS = range(20000, 30000)
"""Ports of SLURM jobs' rendezvous: below Linux's ephemeral ports (32768 up), where no outgoing connection
takes one by chance; job ``N`` tries ``20000 + N % 10000`` first (:func:`slurm_ports`)."""

PORTS_PER_JOB = 16
"""How many ports of :data:`SLURM_PORTS` one job tries, in its own order."""

_CONNECT_S = 2.0  # a port's answer to a TCP connect, and to a store client's handshake
_OWNER_S = 3.0  # the owner key of a store its server has just bound, before the server writes it
_QUIET_S = 30.0  # a port held by a program that is not a store is tried again this much later
_ROUND_S = 0.5  # between two walks over a job's ports, looking for its store
_SAY_AFTER_S = 10.0  # an agent that has not found its store this long says what it waits for


def slurm_port(job_id: str | int) -> int:
    """The first rendezvous port of SLURM job ``job_id`` (``SLURM_JOB_ID``: unique per array task)."""
    return SLURM_PORTS.start + int(job_id) % len(SLURM_PORTS)


def slurm_ports(job_id: str | int) -> tuple[int, ...]:
    """The rendezvous ports of SLURM job ``job_id``, in the order its agents try them: :func:`slurm_port`,
    then ports drawn from a hash of the job id and their index, all distinct, all in :data:`SLURM_PORTS`.
    The same on every node; two jobs whose first ports are the same go on with different ones."""
    ports = [slurm_port(job_id)]
    index = 0
    while len(ports) < PORTS_PER_JOB:
        index += 1
        digest = hashlib.blake2b(f"{int(job_id)}/{index}".encode(), digest_size=8).digest()
        port = SLURM_PORTS.start + int.from_bytes(digest, "big") % len(SLURM_PORTS)
        if port not in ports:
            ports.append(port)
    return tuple(ports)


@dataclass(frozen=True)
class SlurmRendezvous:
    """Where the agents of a SLURM job meet: a store on ``host``, at the first of ``ports`` that its server
    can bind (:func:`claimed_slurm_store`)."""

    host: str
    """The allocation's first node: its name, or its ``NodeAddr`` where the name does not resolve."""
    ports: tuple[int, ...]
    """The job's ports, in the order they are tried (:func:`slurm_ports`)."""
    serves: bool
    """Whether this process serves the store: it runs on ``host`` as the job step's first task
    (``SLURM_PROCID`` 0, or no ``SLURM_PROCID``: then the first agent on ``host`` to bind a port)."""


def slurm_run_id(environ: os._Environ | dict[str, str] | None = None) -> str:
    """The run id of the SLURM job this process runs in: its id (``<array job>_<task>`` for an array task,
    as submitit names it)."""
    environ = os.environ if environ is None else environ
    array = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array[0]}_{array[1]}" if all(array) else environ["SLURM_JOB_ID"]


def slurm_rendezvous(environ: os._Environ | dict[str, str] | None = None) -> SlurmRendezvous:
    """Where the agents of the SLURM job this process runs in meet: the first node of the allocation, the
    job's ports (:func:`slurm_ports`), and whether this process serves the store there.

    Raises:
        RendezvousError: ``SLURM_JOB_NODELIST`` is not set (a container, a shell opened on the node by ssh)
            or ``scontrol`` cannot expand it: the line says to pass ``rdzv_endpoint``.
    """
    environ = os.environ if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise RendezvousError(
            f"SLURM_JOB_ID is set ({environ['SLURM_JOB_ID']}) but SLURM_JOB_NODELIST is not, so the job's "
            "first node is unknown here: pass rdzv_endpoint=host:port (the same on every node)"
        )
    host = _address(_first_host(nodelist))
    serves = environ.get("SLURM_PROCID", "0") == "0" and on_this_machine(host)
    return SlurmRendezvous(host, slurm_ports(environ["SLURM_JOB_ID"]), serves)


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``n[1-2],m3``): as it is where it names one host, else from
    ``scontrol show hostnames``."""
    if not any(c in nodelist for c in "[,"):
        return nodelist
    with contextlib.suppress(ImportError, RuntimeError, KeyError):
        import submitit  # its own parser of node lists, in a job it started

        return submitit.JobEnvironment().hostnames[0]
    try:
        nodes = _scontrol("show", "hostnames", nodelist).split()
    except (OSError, subprocess.CalledProcessError) as error:  # no scontrol here, or it failed
        why = (getattr(error, "stderr", None) or str(error)).strip()
        nodes, failed = [], f"failed ({why.splitlines()[0] if why else 'no output'})"
    else:
        failed = "named no node"
    if not nodes:
        raise RendezvousError(
            f"cannot find the job's first node: `scontrol show hostnames {nodelist}` {failed}; "
            "pass rdzv_endpoint=host:port (the same on every node)"
        )
    return nodes[0]


def _address(node: str) -> str:
    """``node`` if its name resolves here, else the ``NodeAddr`` SLURM has for it."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except socket.gaierror:
        pass
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        for field in _scontrol("show", "node", "--oneliner", node).split():
            if field.startswith("NodeAddr="):
                return field.removeprefix("NodeAddr=")
    return node


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout


# --------------------------------------------------------------------------------------- the store's port


@contextlib.contextmanager
def claimed_slurm_store(
    rendezvous: SlurmRendezvous, run_id: str, timeout_s: float
) -> Iterator[tuple[str, bool]]:
    """Within this block a c10d store of run ``run_id`` answers at one of the job's ports; yields its
    endpoint and whether this process serves it.

    The serving process (:attr:`SlurmRendezvous.serves`) serves the store at the first of the ports it can
    bind, writes ``run_id`` there at once, and takes it out again at the end (as :func:`claimed_store`);
    a port it cannot bind is another program's, or another run's store, and it goes on to the next. Every
    other process walks the ports again and again, up to ``timeout_s``, and takes the first store that
    carries ``run_id``: one it tried before its server had bound it is found on a later walk, and a store
    of another run, or a program that is not a store, is never joined. Only the server writes the run id.

    Raises:
        RendezvousError: the server could bind none of the ports, or no store of this run answered within
            ``timeout_s``.
    """
    host, ports = rendezvous.host, rendezvous.ports
    prober = _Prober(host)
    store, port = (None, None)
    if rendezvous.serves:
        store, port = _serve_first_free(prober, ports, run_id, timeout_s)
        if port is None:
            raise RendezvousError(
                f"no port for the rendezvous of run {run_id!r} on {host}: other programs or other jobs' "
                f"stores hold all {len(ports)} of its ports ({_listed(ports)}); pass rdzv_endpoint=host:port"
            )
    if port is None:
        port = _find_store_of(prober, ports, run_id, timeout_s)
    try:
        yield f"{host}:{port}", store is not None
    finally:
        if store is not None:
            with contextlib.suppress(Exception):
                store.delete_key(OWNER_KEY)


def _serve_first_free(
    prober: _Prober, ports: tuple[int, ...], run_id: str, timeout_s: float
) -> tuple[TCPStore | None, int | None]:
    """Serve a store of ``run_id`` at the first of ``ports`` this process can bind and no other run
    claims: ``(store, port)``; or ``(None, port)``: another agent of this run serves it there (no
    ``SLURM_PROCID``, and a first agent on this host was quicker); or ``(None, None)``: none."""
    from torch.distributed import TCPStore

    for port in ports:
        try:
            store = TCPStore(
                prober.host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            )  # fmt: skip
        except (RuntimeError, ValueError, TimeoutError):  # EADDRINUSE: a program, a store, or our own run's
            if prober.owner(port, wait_s=_OWNER_S) == run_id:
                return None, port
            continue
        if store.compare_set(OWNER_KEY, "", run_id).decode() == run_id:
            return store, port
        del store  # this process serves another run there already (one store server per port)
    return None, None


def _find_store_of(prober: _Prober, ports: tuple[int, ...], run_id: str, timeout_s: float) -> int:
    """The first of ``ports`` whose store carries ``run_id``, walking them until one does."""
    started = time.monotonic()
    said = False
    while True:
        for port in ports:
            if prober.owner(port, wait_s=0.0) == run_id:
                return port
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise RendezvousError(
                f"no rendezvous store of run {run_id!r} on {prober.host} within {timeout_s:g} s, at any of "
                f"the job's ports ({_listed(ports)}): the job's first task, which serves it, did not start"
            )
        if waited > _SAY_AFTER_S and not said:
            print(
                f"distsync.launch: no rendezvous store of run {run_id!r} on {prober.host} yet, at any of the "
                f"job's ports ({_listed(ports)}); waiting for the job's first task to serve it, up to "
                f"{timeout_s:g} s",
                file=sys.stderr,
                flush=True,
            )
            said = True
        time.sleep(_ROUND_S)


def _listed(ports: tuple[int, ...]) -> str:
    return ", ".join(map(str, ports[:4])) + (f", ... {len(ports) - 4} more" if len(ports) > 4 else "")


class _Prober:
    """Whose store answers at a port of ``host``, asked without ever hanging or writing to it.

    A TCP connect first: nothing listening costs nothing. Then a store client, in a thread of its own: a
    program that accepts connections but never answers would hold it forever (torch's handshake waits
    without a timeout), so after :data:`_CONNECT_S` its connection is shut down under it, which ends the
    thread (one left blocked would abort the process at its exit). A port whose program did not answer as
    a store is asked again only :data:`_QUIET_S` later (torch logs each failed handshake at length).
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self._quiet_until: dict[int, float] = {}

    def owner(self, port: int, wait_s: float) -> str | None:
        """The run id in the store at ``port``, waiting up to ``wait_s`` for one to be written; ``""`` for a
        store without one; None where no store answers."""
        if time.monotonic() < self._quiet_until.get(port, 0.0):
            return None
        try:
            with socket.create_connection((self.host, port), timeout=_CONNECT_S):
                pass
        except OSError:
            return None  # nothing listens: no store, not yet, or not any more
        answer: list[str | None] = []
        connected = threading.Event()
        thread = threading.Thread(
            target=self._ask, args=(port, wait_s, answer, connected), name="distsync-rendezvous-probe",
            daemon=True,
        )  # fmt: skip
        thread.start()
        if not connected.wait(2 * _CONNECT_S + 1.0):  # the handshake: a store answers it at once
            _shut_connections_to(port)
        thread.join(wait_s + 2 * _CONNECT_S + 1.0)
        if not answer:
            self._quiet_until[port] = time.monotonic() + _QUIET_S
            return None
        return answer[0]

    def _ask(self, port: int, wait_s: float, answer: list[str | None], connected: threading.Event) -> None:
        from torch.distributed import TCPStore

        try:
            store = TCPStore(self.host, port, is_master=False, timeout=timedelta(seconds=_CONNECT_S))
        except (RuntimeError, TimeoutError, ValueError):  # not a store: the handshake failed
            connected.set()
            return
        connected.set()
        try:
            deadline = time.monotonic() + wait_s
            while not store.check([OWNER_KEY]) and time.monotonic() < deadline:
                time.sleep(0.05)
            answer.append(store.get(OWNER_KEY).decode() if store.check([OWNER_KEY]) else "")
        except (RuntimeError, TimeoutError):  # the store went away meanwhile
            answer.append(None)


def _shut_connections_to(port: int) -> None:
    """Shut down this process's TCP connections to ``port`` (found among its open files): a store client
    blocked on one returns with an error. Nothing else here connects to a port that is not a store."""
    with contextlib.suppress(OSError):
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
        for fd in fds:
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue  # not a socket, or closed meanwhile
            try:
                if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] == port:
                    sock.shutdown(socket.SHUT_RDWR)
            except (OSError, IndexError, TypeError):
                pass
            finally:
                sock.detach()  # the descriptor stays the client's
