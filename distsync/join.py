"""Uneven numbers of batches per rank: synchronized layers under DDP's ``Join`` context manager.

``torch.distributed.algorithms.join.Join`` lets ranks that ran out of data shadow the collectives of the
ranks still training, so that nobody hangs: DDP's join hook shadows its gradient all-reduces. Synchronized
batch norm has collectives of its own in every forward and backward, which nothing shadows. Its joinable
does: a rank that has joined takes part in every synchronized call of each step the others make, with an
empty batch (count 0), forward and backward, so their outputs, gradients and running statistics are those
of ``nn.BatchNorm`` on the batches that exist that step, and its own running statistics follow theirs.

It replays the synchronized calls of its own last step, in the order they were made, forward and backward.
A model whose synchronized calls change from step to step makes the replay disagree with the others' calls,
and every rank raises :class:`distsync.SyncMismatchError`. The layers' collectives run on a process group
of their own (the same ranks), and a joined rank replays them on a thread of its own while DDP's join hook
shadows DDP's collectives, which the others make before their forward and at the end of their backward.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import batchnorm
from .batchnorm import DistSyncBatchNorm

__all__ = ["joinable"]


class _Forward(NamedTuple):
    layer: weakref.ref
    shape: tuple[int, ...]  # the input's shape past the batch dimension
    dtype: torch.dtype
    device: torch.device


class _Backward(NamedTuple):
    forward: int  # which forward call of the step this backward call belongs to


class _SyncedLayersJoinable(Joinable):
    """The synchronized layers of one model, as a ``Joinable`` (see :func:`joinable`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = model
        layers = [m for m in model.modules() if isinstance(m, DistSyncBatchNorm)]
        self._layers = weakref.WeakSet(layers)
        if any(layer.process_group is None for layer in layers):
            group = dist.new_group()  # the same ranks, apart from DDP's collectives (made on every rank)
            for layer in layers:
                if layer.process_group is None:
                    layer.process_group = group
        self._steps: list[Any] = []  # the synchronized calls of this rank's step so far
        self._last_step: list[Any] = []  # those of its last finished step
        self._replaying = False
        self._replayed: list[Tensor] = []
        model.register_forward_pre_hook(self._new_step)
        batchnorm._call_observers.append(self._observe)

    @property
    def join_device(self) -> torch.device:
        return self._model.join_device if hasattr(self._model, "join_device") else _device_of(self._model)

    @property
    def join_process_group(self) -> Any:
        if hasattr(self._model, "join_process_group"):
            return self._model.join_process_group
        return dist.group.WORLD

    def join_hook(self, **kwargs) -> JoinHook:
        return _ReplayHook(self)

    def _new_step(self, module, args) -> None:
        config = self._join_config
        if config.enable and not config.is_first_joinable:  # the same Join on every rank: all raise here
            raise ValueError(
                "distsync.joinable must come first in Join: Join([distsync.joinable(ddp_model), ddp_model]). "
                "A joined rank starts replaying the synchronized layers' calls before DDP's join hook waits "
                "for the others' gradient all-reduces"
            )
        work = Join.notify_join_context(self)  # the first joinable's "not joined yet" all-reduce
        if work is not None and hasattr(self._model, "reducer"):  # what DDP does with it when it is first
            self._model.reducer._set_forward_pass_work_handle(work, self._model._divide_by_initial_world_size)
        if self._steps:
            self._last_step, self._steps = self._steps, []

    def _observe(self, layer: DistSyncBatchNorm, input: Tensor, output: Tensor | None) -> None:
        if layer not in self._layers or output is None:
            return
        if self._replaying:
            self._replayed.append(output)
            return
        index = len([e for e in self._steps if isinstance(e, _Forward)])
        self._steps.append(_Forward(weakref.ref(layer), tuple(input.shape[1:]), input.dtype, input.device))
        if output.grad_fn is not None:
            output.grad_fn.register_prehook(lambda grads, index=index: self._backward_made(index))

    def _backward_made(self, index: int) -> None:
        if not self._replaying:
            self._steps.append(_Backward(index))

    def replay_step(self) -> None:
        """Take part, with empty batches, in the synchronized calls of one step of the others."""
        step = self._steps or self._last_step
        if not step:
            raise RuntimeError(
                "distsync.joinable: this rank joined before its first step, so it cannot tell which "
                "synchronized calls the others make; every rank needs at least one batch"
            )
        self._replaying = True
        try:
            with torch.enable_grad():
                for event in step:
                    if isinstance(event, _Forward):
                        self._replay_forward(event)
                    else:
                        output = self._replayed[event.forward]
                        output.grad_fn.apply(torch.zeros_like(output))  # sends zero gradient sums
        finally:
            self._replaying = False
            self._replayed = []

    def _replay_forward(self, event: _Forward) -> None:
        layer = event.layer()
        if layer is None:
            raise RuntimeError("distsync.joinable: a synchronized layer of the model is gone")
        empty = torch.zeros((0, *event.shape), dtype=event.dtype, device=event.device, requires_grad=True)
        layer(empty)


class _ReplayHook(JoinHook):
    """Replays each step on a thread of its own: DDP's join hook, on this one, makes the collectives the
    others make before and after their synchronized calls (bucket rebuilds, gradient all-reduces), and
    each of the two sequences must meet the others' as they come, on its own process group."""

    def __init__(self, joinable: _SyncedLayersJoinable) -> None:
        self._joinable = joinable
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def main_hook(self) -> None:
        self._wait()
        self._thread = threading.Thread(target=self._replay, name="distsync-join-replay", daemon=True)
        self._thread.start()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._wait()

    def _replay(self) -> None:
        try:
            self._joinable.replay_step()
        except BaseException as error:  # raised on the main thread, at the next hook
            self._error = error

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def joinable(model: nn.Module) -> Joinable:
    """The synchronized layers of ``model`` as a ``Joinable``, for ranks with uneven numbers of batches.

    Make it on every rank before the first step, and pass it to ``Join`` first, then the DDP model::

        >>> ddp_model = DistributedDataParallel(model, forward_sync_buffers=False)
        >>> layers = distsync.joinable(ddp_model)
        >>> with Join([layers, ddp_model]):
        ...     for x, y in loader:  # uneven lengths across ranks
        ...         loss_fn(ddp_model(x), y).backward()
        ...         optimizer.step()

    A rank whose loader ran out takes part in the others' synchronized calls with empty batches, so each
    step's outputs, gradients and running statistics are those of ``nn.BatchNorm`` on the batches that exist
    that step. Layers that sync over the default group get a group of their own with the same ranks (created
    here, on every rank), so their all-reduces never interleave with DDP's. A model whose synchronized calls
    change between steps makes every rank raise ``SyncMismatchError``.

    Args:
        model: the DDP-wrapped model (or the model itself), whose forward starts each step
    """
    return _SyncedLayersJoinable(model)
