"""The job's few collectives outside the model: sums, rank 0's decisions, and per-rank state for a checkpoint.

Each is a no-op (or the trivial answer) in a single process, so the trainer calls them unconditionally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distsync.distributed import get_rank, get_world_size, is_distributed

__all__ = ["all_reduce", "broadcast_object", "gather_object", "all_gather_object"]


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """Reduce ``tensor`` in place over every rank."""
    if is_distributed():
        dist.all_reduce(tensor, op)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_object(obj: Any) -> list | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    if not is_distributed():
        return [obj]
    out = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_object(obj: Any) -> list:
    """Every rank's ``obj`` on every rank, in rank order."""
    if not is_distributed():
        return [obj]
    out: list = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out
