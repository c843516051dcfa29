"""Where the nodes of one job meet, and that no other job meets them there.

A multi-node world meets in the c10d rendezvous store that the agent on the endpoint's host serves. Two jobs
at one endpoint would meet in one store: the second job's agents would connect to the first job's store as
clients, and die with it when the first job ends. So

* under SLURM, the endpoint follows from the job: the first node of the allocation (its address as SLURM
  knows it, where its name does not resolve) and a port computed from the job id
  (:func:`slurm_rendezvous`): two jobs whose first node is the same meet on ports of their own; a job
  requeued keeps its id, its port and its run;
* whatever the endpoint, the store carries the run it belongs to (:func:`claimed_store`): the first agent to
  reach it writes its run id there, and an agent of another run is refused with one line naming both
  (:class:`RendezvousError`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
from collections.abc import Iterator
from datetime import timedelta

__all__ = ["RendezvousError", "claimed_store", "on_this_machine", "slurm_port", "slurm_rendezvous"]

SLURM_PORTS = range(20000, 30000)
"""Ports of SLURM jobs' rendezvous: below Linux's ephemeral ports (32768 up), where no outgoing connection
takes one by chance; job ``N`` meets on ``20000 + N % 10000``."""

OWNER_KEY = "distsync/rendezvous_run"
"""The store key holding the run id of the job the store belongs to."""


class RendezvousError(RuntimeError):
    """The rendezvous store at the endpoint belongs to another run, or never came up."""


def slurm_port(job_id: str | int) -> int:
    """The rendezvous port of SLURM job ``job_id`` (numeric: ``SLURM_JOB_ID``, unique per array task)."""
    return SLURM_PORTS.start + int(job_id) % len(SLURM_PORTS)


def slurm_rendezvous(environ: os._Environ | dict[str, str] | None = None) -> tuple[str, str]:
    """``(endpoint, run id)`` of the SLURM job this process runs in: the first node's address and the job's
    port (:func:`slurm_port`), and the job's id (submitit's, ``<array job>_<task>`` for an array task)."""
    environ = os.environ if environ is None else environ
    host, job_id = _first_host_and_id(environ)
    return f"{_address(host)}:{slurm_port(environ['SLURM_JOB_ID'])}", job_id


def _first_host_and_id(environ) -> tuple[str, str]:
    """First host of the allocation and the job id, from submitit or else ``scontrol``."""
    try:
        import submitit

        env = submitit.JobEnvironment()
        return env.hostnames[0], str(env.job_id)
    except (ImportError, RuntimeError):
        pass
    nodes = _scontrol("show", "hostnames", environ["SLURM_JOB_NODELIST"]).split()
    array = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array[0]}_{array[1]}" if all(array) else environ["SLURM_JOB_ID"]
    return (nodes[0] if nodes else socket.gethostname()), job_id


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


# ------------------------------------------------------------------------------------------- the store


def on_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine, as torch's c10d rendezvous decides who serves its store:
    ``localhost``, a loopback address, this host's name, or an address this host's name resolves to."""
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return True
    this = socket.gethostname()
    if host in (this, socket.getfqdn()):
        return True
    try:
        theirs = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        ours = socket.getaddrinfo(this, None, proto=socket.IPPROTO_TCP, flags=socket.AI_CANONNAME)
    except (socket.gaierror, UnicodeError):
        return False
    return any(info[3] == host or info[4][0] in theirs for info in ours)


@contextlib.contextmanager
def claimed_store(endpoint: str, run_id: str, timeout_s: float) -> Iterator[bool]:
    """Within this block the c10d store at ``endpoint`` is this run's, or :class:`RendezvousError` says
    whose it is; yields whether this process serves it.

    On the endpoint's host the first agent serves the store from here on (torch's rendezvous, started in
    this process afterwards, shares that server: its stores are multi-tenant); any other agent connects as a
    client, waiting for the server up to ``timeout_s``. Either way the run id is written into the store if
    none is there yet, and compared with the one there. The serving agent takes it out again at the end, so
    that the next run of this process (a sweep's next job) may meet there.
    """
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    host = host or "localhost"
    store, serving = None, False
    if on_this_machine(host):
        with contextlib.suppress(RuntimeError, ValueError, TimeoutError):  # EADDRINUSE: another agent's
            store = TCPStore(
                host, int(port), is_master=True, multi_tenant=True, wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            )  # fmt: skip
            serving = True
    if store is None:
        try:
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, TimeoutError) as error:  # torch's DistNetworkError, DistStoreError
            raise RendezvousError(
                f"no rendezvous store at {endpoint} within {timeout_s:g} s: the node that serves it "
                f"did not start ({str(error).splitlines()[0]})"
            ) from None
    owner = store.compare_set(OWNER_KEY, "", run_id).decode()
    if owner != run_id:
        raise RendezvousError(
            f"the rendezvous store at {endpoint} belongs to run {owner!r}, not to this job's run {run_id!r}: "
            "another job meets there; give this one its own rdzv_endpoint"
        )
    if not serving:
        del store  # torch's rendezvous connects on its own
    try:
        yield serving
    finally:
        if serving:
            with contextlib.suppress(Exception):
                store.delete_key(OWNER_KEY)
