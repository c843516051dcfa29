"""Process-group setup for torchrun workers and small rank-aware helpers."""

from __future__ import annotations

import atexit
import ctypes
import datetime
import inspect
import os
import time

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["init_distributed", "is_distributed", "get_rank", "get_world_size", "no_buffer_broadcast"]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank in the default group, 0 when not distributed."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of ranks in the default group, 1 when not distributed."""
    return dist.get_world_size() if is_distributed() else 1


def no_buffer_broadcast() -> dict[str, bool]:
    """``DistributedDataParallel``'s keyword that turns off its buffer broadcast before each forward, in
    this torch release's spelling: ``forward_sync_buffers=False`` from torch 2.13, ``broadcast_buffers=False``
    before (deprecated from 2.13).

    Synchronized layers keep their running statistics equal on every rank of their group by themselves, so
    the broadcast only costs a collective per step, hides whether they agree, and with several BN process
    groups gives every group rank 0's statistics::

        >>> ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    """
    parameters = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"
    return {key: False}


def init_distributed(
    backend: str = "auto",
    timeout: datetime.timedelta | float | None = None,
) -> torch.device:
    """Join the torchrun world described by the environment and return this rank's device.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as set by torchrun.
    With ``backend="auto"`` it picks ``nccl`` and ``cuda:LOCAL_RANK`` when CUDA is available, otherwise
    ``gloo`` and the CPU. It creates no group when the default group already exists, and when no torchrun
    environment is present it returns the device without creating a group, so the same script runs
    single-process. Under torchrun it rendezvouses through the agent's store with a key prefix per restart,
    so workers restarted by ``--max-restarts`` join cleanly. A gloo default group (created here or before) is
    kept alive until the process ends, so the script ends cleanly whether or not it calls
    ``destroy_process_group()``, even when a DDP model outlives the group (see :func:`_keep_until_exit`).

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
    if not is_distributed() and "WORLD_SIZE" in os.environ:
        _init_process_group(backend, use_cuda, device, timeout)
    if is_distributed():
        _keep_until_exit(dist.group.WORLD)
    return device


def _init_process_group(
    backend: str, use_cuda: bool, device: torch.device, timeout: datetime.timedelta | float | None
) -> None:
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


_kept_groups: list[dist.ProcessGroup] = []


def _keep_until_exit(group: dist.ProcessGroup) -> None:
    """Keep a gloo group alive until the process ends, so that its destructor never runs.

    The destructor joins the group's worker threads. Where the last reference to the group is dropped
    from C++ with the GIL held, the join can wait forever on a worker thread that waits for the GIL
    (pytorch#190489): DDP's ``Reducer`` drops it so when a DDP model outlives ``destroy_process_group()``
    (timm's ``train.py`` ends so) or is freed at interpreter exit, and a worker needs the GIL to free a
    finished collective whose tensor Python let go of, or to run a Python callback. Holding one reference
    that is never released leaves the group's threads and sockets to the operating system when the process
    ends, as any process's; how it ends is untouched: exit code, exit handlers, output, child processes.
    """
    if dist.get_backend(group) != "gloo" or any(group is kept for kept in _kept_groups):
        return
    # A reference in a Python container would be dropped by the interpreter's teardown: take one that
    # nothing releases.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    if not _kept_groups:
        atexit.register(_let_finished_collectives_go)
    _kept_groups.append(group)


_EXIT_GRACE_S = 0.1


def _let_finished_collectives_go() -> None:
    """Give the kept groups' worker threads the GIL once more before the interpreter finalizes.

    A gloo worker frees a collective after its caller has the result, and a collective issued during a
    backward holds a Python object (the backward's ``contextvars`` context, stashed in the thread-local
    state it captured), whose release needs the GIL. A worker that asks for it once the interpreter is
    finalizing is ended by Python inside a C++ destructor, which aborts the process ("terminate called
    without an active exception") after a script that ended right after its last step. Run from ``atexit``,
    before finalization: the workers finish in microseconds; this waits a tenth of a second for them.
    """
    time.sleep(_EXIT_GRACE_S)


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
