"""Transports that sum a sync payload over everyone sharing a batch-norm layer's statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from distsync import _torch_compat

if TYPE_CHECKING:
    from distsync._syncbn.payload import SyncState


class Call(NamedTuple):
    """A synchronized call as a rank without a batch needs it to take part (see :mod:`distsync.join`)."""

    direction: int  # FORWARD or BACKWARD
    state: SyncState  # the layer's: its identity
    channels: int
    dtype: torch.dtype  # the input's (forward)
    momentum: float | None = None
    eps: float = 0.0
    running_mean: Tensor | None = None  # the running statistics the call updates (None: none)
    running_var: Tensor | None = None
    counts: bool = False  # the call counts the batch in the layer's num_batches_tracked (else its caller did)


class Reducer(Protocol):
    """Sums a tensor over all participants; every participant gets the same result."""

    world_size: int
    first: bool  # exactly one participant is first

    def all_reduce(self, payload: Tensor) -> Tensor: ...

    def announce(self, call: Call) -> None:
        """Say that ``call``'s all-reduce comes next, to participants who cannot know (ranks that joined
        under DDP's ``Join``); a no-op for the others."""


class ProcessGroupReducer:
    """One ``all_reduce(SUM)`` on a ``torch.distributed`` process group."""

    def __init__(self, process_group: dist.ProcessGroup | None, world_size: int) -> None:
        self.process_group = process_group
        self.world_size = world_size
        self.first = dist.get_rank(process_group) == 0

    @property
    def timeout(self) -> float | None:
        """How long a collective of the group may wait for a peer, in seconds (None if unknown)."""
        return _torch_compat.process_group_timeout(self.process_group)

    def all_reduce(self, payload: Tensor) -> Tensor:
        dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.process_group)
        return payload

    def announce(self, call: Call) -> None:
        """Every participant makes every call itself: nothing to say."""


def process_group_reducer(process_group: dist.ProcessGroup | None) -> ProcessGroupReducer | None:
    """A reducer over ``process_group`` (default group if None), or None when there is nobody to sync with."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(process_group)
    if world_size <= 1:
        return None
    return ProcessGroupReducer(process_group, world_size)
