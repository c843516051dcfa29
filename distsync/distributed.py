"""Process-group setup for torchrun workers and small rank-aware helpers."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "is_distributed", "get_rank", "get_world_size"]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank in the default group, 0 when not distributed."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of ranks in the default group, 1 when not distributed."""
    return dist.get_world_size() if is_distributed() else 1


def init_distributed(
    backend: str = "auto",
    timeout: datetime.timedelta | float | None = None,
) -> torch.device:
    """Join the torchrun world described by the environment and return this rank's device.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as set by torchrun.
    With ``backend="auto"`` it picks ``nccl`` and ``cuda:LOCAL_RANK`` when CUDA is available, otherwise
    ``gloo`` and the CPU. It is a no-op (returning the device) when the default group already exists, and
    when no torchrun environment is present it returns the device without creating a group, so the same
    script runs single-process. Under torchrun it rendezvouses through the agent's store with a key prefix per
    restart, so workers restarted by ``--max-restarts`` join cleanly.

    Args:
        backend: ``"auto"``, or any backend name ``torch.distributed`` accepts. Default: ``"auto"``
        timeout: collective timeout, a ``timedelta`` or seconds. Default: the backend's default
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():  # NCCL rejects two ranks on one GPU; so do we
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPU(s): start at "
                "most one process per GPU (torchrun --nproc_per_node), or pass backend='gloo' for the CPU"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if is_distributed() or "WORLD_SIZE" not in os.environ:
        return device
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if backend == "nccl":
        kwargs["device_id"] = device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs.update(_restart_safe_store(timeout))
    dist.init_process_group(backend=backend, **kwargs)
    return device


def _restart_safe_store(timeout: datetime.timedelta | None) -> dict:
    """Rendezvous through torchrun's agent store under a per-restart key prefix.

    The agent keeps one store across restarts of the worker group without separating attempts, so restarted
    workers can read the previous attempt's keys and hang in ``init_process_group`` (pytorch#135712).
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        **({"timeout": timeout} if timeout is not None else {}),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"distsync/attempt_{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }
