"""Process groups for synchronized batch norm at scale: statistics shared within groups of k ranks."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["create_syncbn_process_group"]

# What a process_group argument accepts: a group, a one-dimensional DeviceMesh, (mesh, dim), or None.
GroupSpec = Union[dist.ProcessGroup, "DeviceMesh", tuple["DeviceMesh", "str | int"], None]


def create_syncbn_process_group(group_size: int | str) -> dist.ProcessGroup | None:
    """This rank's group of ``group_size`` consecutive ranks, or with ``"node"`` of the ranks on its node,
    to pass as ``process_group=``.

    apex's recipe for large worlds: batch statistics are synchronized within groups of ``group_size``
    ranks (ranks ``0..k-1``, ``k..2k-1``, ...) instead of over the whole world, which bounds the cost of
    each BN sync and keeps the per-group batch at ``k`` times the per-rank batch. Every rank must call it,
    in the same order relative to its other group creations, with the same ``group_size`` (a rank that
    differs makes every rank raise): it creates every group. ``0`` or the world size mean the whole world
    (``None``, the default group).

    ``"node"`` syncs within each node (SwAV's and Classy Vision's accuracy-neutral speed-up: the all-reduce
    never leaves the node). A node is an agent of torchrun (its ``GROUP_RANK``), or a host name outside
    torchrun; every rank checks that its node has as many ranks as torchrun's ``LOCAL_WORLD_SIZE`` says.
    One node means the whole world (``None``).

    Args:
        group_size: ranks per group, which must divide the world size; or ``"node"``

    Example::

        >>> group = distsync.create_syncbn_process_group(8)
        >>> model = distsync.convert_sync_batchnorm(model, process_group=group)
    """
    if group_size == "node":
        return _node_group()
    if not isinstance(group_size, int):
        raise ValueError(f"group_size must be a number of ranks or 'node', got {group_size!r}")
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


def _node_group() -> dist.ProcessGroup | None:
    """This rank's group of the ranks on its node (every rank creates every node's group)."""
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")
    me = (os.environ.get("GROUP_RANK"), socket.gethostname(), local_world_size)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    # torchrun's node rank tells agents apart, even two on one host; the host name is the fallback.
    by_agent = all(node is not None for node, _, _ in everyone)
    nodes: dict[str, list[int]] = {}
    for rank, (node, host, _) in enumerate(everyone):
        nodes.setdefault(f"agent {node}" if by_agent else f"host {host}", []).append(rank)
    for name, ranks in nodes.items():  # the same verdict on every rank: all of them see all of this
        declared = {everyone[r][2] for r in ranks}
        if declared != {None} and declared != {str(len(ranks))}:
            raise ValueError(
                f"create_syncbn_process_group('node'): {name} has {len(ranks)} rank(s) ({ranks}) but they "
                f"report LOCAL_WORLD_SIZE {sorted(map(str, declared))}; start the same number of workers on "
                "every node with torchrun"
            )
    if len(nodes) == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(list(nodes.values()))
    return group


def as_process_group(group: GroupSpec) -> dist.ProcessGroup | None:
    """``group`` as a process group: a ``DeviceMesh`` of one dimension, or ``(mesh, dim)`` for one of its
    dimensions, gives that dimension's group; anything else is returned as it is."""
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group"):
        mesh, dim = group
        return mesh.get_group(dim)
    if hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        if group.ndim != 1:
            names = getattr(group, "mesh_dim_names", None) or range(group.ndim)
            raise ValueError(
                f"a DeviceMesh of {group.ndim} dimensions syncs over which one? Pass (mesh, dim), with dim "
                f"one of {list(names)}"
            )
        return group.get_group()
    return group
