"""Transports that sum a sync payload over everyone sharing a batch-norm layer's statistics."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Reducer(Protocol):
    """Sums a tensor over all participants; every participant gets the same result."""

    world_size: int
    first: bool  # exactly one participant is first

    def all_reduce(self, payload: Tensor) -> Tensor: ...


class ProcessGroupReducer:
    """One ``all_reduce(SUM)`` on a ``torch.distributed`` process group."""

    def __init__(self, process_group: dist.ProcessGroup | None, world_size: int) -> None:
        self.process_group = process_group
        self.world_size = world_size
        self.first = dist.get_rank(process_group) == 0

    @property
    def timeout(self) -> float | None:
        """How long a collective of the group may wait for a peer, in seconds (None if unknown)."""
        return _timeout_seconds(self.process_group)

    def all_reduce(self, payload: Tensor) -> Tensor:
        dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.process_group)
        return payload


def _timeout_seconds(process_group: dist.ProcessGroup | None) -> float | None:
    group = process_group or dist.group.WORLD
    try:
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        backend = group._get_backend(device)
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):  # a backend without options (fake, custom)
        return None


def process_group_reducer(process_group: dist.ProcessGroup | None) -> ProcessGroupReducer | None:
    """A reducer over ``process_group`` (default group if None), or None when there is nobody to sync with."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(process_group)
    if world_size <= 1:
        return None
    return ProcessGroupReducer(process_group, world_size)
