"""The replica-thread transport: sums a sync payload over the ``nn.DataParallel`` copies of one process.

The second transport beneath :class:`~distsync.functional.SyncBatchNormFunction` (the first is the process
group): the same payloads, the same moment math. The copies of a layer meet through a
:class:`~distsync.parallel.comm.SyncMaster`; the master copy's thread sums their payloads and, when a process
group of more than one rank is initialized, all-reduces that sum across ranks (hierarchical sync), so
``world_size`` is copies x ranks and the call-identity check of the payload holds for both levels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from distsync._syncbn.payload import ProcessGroupReducer, process_group_reducer
from distsync.errors import SyncError
from distsync.parallel.comm import SlavePipe, SyncMaster

__all__ = ["ReplicaReducer", "replica_reducer", "REPLICA_SYNC_TIMEOUT"]

REPLICA_SYNC_TIMEOUT = 300.0
"""Seconds a copy waits for its sibling copies before every copy raises (read when replicas are wired)."""


_ONE_THREAD = (
    "the nn.DataParallel copies of a synchronized batch norm meet in backward, each on the autograd thread "
    "of its device, but this backward runs on one thread (torch.autograd.set_multithreading_enabled(False)): "
    "the first copy would wait for the others forever. Run the backward with multithreading enabled (torch's "
    "default), or move to torchrun + DistributedDataParallel (docs/migration.md)."
)


class _ReplicaGroup:
    """What the copies of one layer share during one replication: the rendezvous and the rank reducer."""

    def __init__(self, ranks: ProcessGroupReducer | None, timeout: float | None) -> None:
        self.ranks = ranks
        self.master = SyncMaster(self._combine, timeout)
        self.device = torch.device("cpu")

    def _combine(self, intermediates: list[tuple[int, Tensor]]) -> list[tuple[int, Tensor]]:
        """Master callback: the sum over copies (in copy order, for determinism), then over ranks."""
        ordered = [payload for _, payload in sorted(intermediates, key=lambda item: item[0])]
        total = torch.stack(ordered).sum(0)
        if self.ranks is not None:
            total = self.ranks.all_reduce(total.to(self.device)).cpu()
        return [(copy_id, total) for copy_id, _ in intermediates]


class ReplicaReducer:
    """A :class:`~distsync._syncbn.payload.Reducer` for one copy of a layer that ``nn.DataParallel``
    replicated.

    ``all_reduce`` blocks until every copy of the layer in this process has sent its payload for the same
    call, then returns the sum over copies (and over the ranks of the process group, if any). Payloads
    travel through host memory: they are O(C) float64 vectors, and ``unpack`` reads them on the host anyway.
    Waits are bounded by :data:`REPLICA_SYNC_TIMEOUT`; a failure on one copy makes every copy raise. A
    backward run on one thread (``torch.autograd.set_multithreading_enabled(False)``) raises at once: the
    copies' backward passes would run one after another, the first waiting for the others.

    Every process of a hierarchical run must replicate over the same number of devices.
    """

    def __init__(self, group: _ReplicaGroup, copy_id: int) -> None:
        self._group = group
        self.copy_id = copy_id
        self._pipe: SlavePipe | None = None if copy_id == 0 else group.master.register_slave(copy_id)

    @property
    def first(self) -> bool:
        return self.copy_id == 0 and (self._group.ranks is None or self._group.ranks.first)

    @property
    def world_size(self) -> int:
        ranks = 1 if self._group.ranks is None else self._group.ranks.world_size
        return (self._group.master.nr_slaves + 1) * ranks

    def announce(self, call) -> None:
        """Every copy makes every call itself: nothing to say."""

    def all_reduce(self, payload: Tensor) -> Tensor:
        if not torch.autograd.is_multithreading_enabled():
            # Only in a backward run under torch.autograd.set_multithreading_enabled(False): the copies'
            # backward passes then run one after another on this thread, the first waiting for the others.
            error = SyncError(_ONE_THREAD)
            self._group.master.abort(error)
            raise error
        message = payload.detach().cpu()
        if self._pipe is None:
            self._group.device = payload.device
            total = self._group.master.run_master(message)
        else:
            total = self._pipe.run_slave(message)
        return payload.copy_(total)


def replica_reducer(ctx, copy_id: int, process_group: dist.ProcessGroup | None) -> ReplicaReducer:
    """Join copy ``copy_id`` of a layer to its siblings through the shared replication context ``ctx``.

    Copy 0 (always wired first) creates the group and publishes its master as ``ctx.sync_master``, the
    attribute Synchronized-BatchNorm used, through which a failing replica aborts its siblings.
    """
    if copy_id == 0:
        ctx.replica_group = _ReplicaGroup(process_group_reducer(process_group), REPLICA_SYNC_TIMEOUT)
        ctx.sync_master = ctx.replica_group.master
    return ReplicaReducer(ctx.replica_group, copy_id)
