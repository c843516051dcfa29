"""Process groups for synchronized batch norm at scale: statistics shared within groups of k ranks."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["create_syncbn_process_group"]


def create_syncbn_process_group(group_size: int) -> dist.ProcessGroup | None:
    """This rank's group of ``group_size`` consecutive ranks, to pass as ``process_group=``.

    apex's recipe for large worlds: batch statistics are synchronized within groups of ``group_size``
    ranks (ranks ``0..k-1``, ``k..2k-1``, ...) instead of over the whole world, which bounds the cost of
    each BN sync and keeps the per-group batch at ``k`` times the per-rank batch. Every rank must call it,
    in the same order relative to its other group creations: it creates every group. ``0`` or the world
    size mean the whole world (``None``, the default group).

    Args:
        group_size: ranks per group; must divide the world size

    Example::

        >>> group = distsync.create_syncbn_process_group(8)
        >>> model = distsync.convert_sync_batchnorm(model, process_group=group)
    """
    world_size = dist.get_world_size()
    if group_size in (0, world_size):
        return None
    if group_size < 0 or world_size % group_size:
        raise ValueError(f"group_size={group_size} must be a positive divisor of the world size {world_size}")
    group, _ = dist.new_subgroups(group_size)
    return group
