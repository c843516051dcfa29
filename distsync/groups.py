"""Process groups for synchronized batch norm at scale: statistics shared within groups of k ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["create_syncbn_process_group"]


def create_syncbn_process_group(group_size: int) -> dist.ProcessGroup | None:
    """This rank's group of ``group_size`` consecutive ranks, to pass as ``process_group=``.

    apex's recipe for large worlds: batch statistics are synchronized within groups of ``group_size``
    ranks (ranks ``0..k-1``, ``k..2k-1``, ...) instead of over the whole world, which bounds the cost of
    each BN sync and keeps the per-group batch at ``k`` times the per-rank batch. Every rank must call it,
    in the same order relative to its other group creations, with the same ``group_size`` (a rank that
    differs makes every rank raise): it creates every group. ``0`` or the world size mean the whole world
    (``None``, the default group).

    Args:
        group_size: ranks per group; must divide the world size

    Example::

        >>> group = distsync.create_syncbn_process_group(8)
        >>> model = distsync.convert_sync_batchnorm(model, process_group=group)
    """
    world_size = dist.get_world_size()
    if group_size == 0:  # the same as the world size: ranks passing either agree
        group_size = world_size
    smallest, largest = _extremes(group_size)
    if smallest != largest:  # new_subgroups would hang, or build groups that overlap
        raise ValueError(
            f"create_syncbn_process_group: the ranks disagree on group_size (from {smallest} to {largest}); "
            "every rank must pass the same value"
        )
    if group_size == world_size:
        return None
    if group_size < 0 or world_size % group_size:
        raise ValueError(f"group_size={group_size} must be a positive divisor of the world size {world_size}")
    group, _ = dist.new_subgroups(group_size)
    return group


def _extremes(value: int) -> tuple[int, int]:
    """The smallest and largest ``value`` over all ranks, so that every rank takes the same decision."""
    device = torch.device("cpu")
    if dist.get_backend() == dist.Backend.NCCL:
        device = torch.device("cuda", torch.cuda.current_device())
    both = torch.tensor([-value, value], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return -int(both[0]), int(both[1])
