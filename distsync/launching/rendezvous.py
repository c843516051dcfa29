"""Where the nodes of one job meet, and that no other job meets them there.

A multi-node world meets in the c10d rendezvous store that the agent on the endpoint's host serves. Two jobs
at one endpoint would meet in one store: the second job's agents would connect to the first job's store as
clients, and die with it when the first job ends. So whatever the endpoint, the store carries the run it
belongs to (:func:`claimed_store`): the first agent to reach it writes its run id there, and an agent of
another run is refused with one line naming both (:class:`RendezvousError`). Under SLURM the endpoint follows
from the job, on a port no other run holds (:mod:`~distsync.launching.slurm_rendezvous`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

__all__ = ["OWNER_KEY", "RendezvousError", "check_store_answers", "claimed_store", "on_this_machine"]

OWNER_KEY = "distsync/rendezvous_run"
"""The store key holding the run id of the job the store belongs to."""


class RendezvousError(RuntimeError):
    """The rendezvous store at the endpoint belongs to another run, or never came up, or its endpoint
    cannot be found."""


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


def check_store_answers(endpoint: str, timeout_s: float) -> None:
    """If a process already listens at ``endpoint``, it must answer as a torch store within ``timeout_s``,
    or :class:`RendezvousError` says so.

    It is then the rendezvous store of another node of this job (or of another job at the same
    endpoint). A program that accepts connections there but never answers (another service on that
    port) would hold torch's store client forever, silently: so try a client here, in a thread that
    may stay blocked, and give up after the rendezvous timeout with a message naming the endpoint.
    """
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host or "localhost", int(port)), timeout=5):
            pass
    except (OSError, ValueError):
        return  # nobody listens (yet): torch hosts the store there, or waits for the node that will
    answered = threading.Event()

    def probe() -> None:
        try:  # its own timeout outlasts the waits below: a silent port is told by them, not by a race with it
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s + 10))
            store.check(["distsync"])
        except Exception:  # torch's own rendezvous then reports the store's error
            pass
        answered.set()

    threading.Thread(target=probe, name="distsync-rendezvous-probe", daemon=True).start()
    if answered.wait(min(5.0, timeout_s)):
        return
    print(
        f"distsync.launch: {endpoint} accepts connections but does not answer as a rendezvous store "
        f"(another program on that port?); waiting up to {timeout_s:g} s",
        file=sys.stderr,
        flush=True,
    )
    if not answered.wait(max(timeout_s - 5.0, 0.0)):
        raise RendezvousError(
            f"no rendezvous at {endpoint} within {timeout_s:g} s: a program that is not a torch store "
            "holds that port; choose another rdzv_endpoint"
        )
