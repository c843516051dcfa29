"""The rendezvous of a one-node world (``standalone``): the agent's store on a free port, at once.

``torchrun --standalone`` meets through torch's dynamic ``c10d`` rendezvous on ``localhost:0``, which is
built for nodes that join over time: it first sleeps a random 0-0.3 s (to spread the nodes' first calls),
then runs its join protocol through the store, and closes the rendezvous through it at the end. With one
node there is no one to wait for, and every job of a sweep paid that before its first line. This handler
hosts the agent's ``TCPStore`` on a free port and returns at once; the workers use that store, as under
torch's ``static`` rendezvous (``TORCHELASTIC_USE_AGENT_STORE``), and a restarted world meets on it again.

Registered in torch's rendezvous registry, under :data:`BACKEND`, by :func:`backend` (when a launch first
needs it, never at import); the public API of ``torch.distributed.elastic.rendezvous``.
"""

from __future__ import annotations

import datetime
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

__all__ = ["BACKEND", "backend"]

BACKEND = "distsync-local"
_HOST = "localhost"


class OneNodeRendezvous(RendezvousHandler):
    """A world of one node: rank 0 of 1, on a store this agent hosts at a free port."""

    def __init__(self, run_id: str, timeout_s: float) -> None:
        self.run_id, self.timeout = run_id, datetime.timedelta(seconds=timeout_s)
        self._store: TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = TCPStore(_HOST, 0, 1, True, self.timeout, multi_tenant=True)
        store: Store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(_HOST, self._store.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def _create(params: RendezvousParameters) -> OneNodeRendezvous:
    timeout: Any = params.config.get("timeout", params.config.get("join_timeout", 600))
    return OneNodeRendezvous(params.run_id, float(timeout))


def backend() -> str:
    """The name of this rendezvous in torch's registry, registered on the first call."""
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND
