"""Uneven numbers of batches per rank: synchronized layers under DDP's ``Join`` context manager.

``torch.distributed.algorithms.join.Join`` lets ranks that ran out of data shadow the collectives of the
ranks still training, so that nobody hangs: DDP's join hook shadows its gradient all-reduces. Synchronized
batch norm has collectives of its own in every forward and backward, which nothing shadows. Its joinable
does: a rank that has joined takes part in every synchronized call of each step the others make, with an
empty batch (count 0), forward and backward, so their outputs, gradients and running statistics are those
of ``nn.BatchNorm`` on the batches that exist that step, and its own running statistics follow theirs.

It replays the synchronized calls of its own last step, in the order they were made, forward and backward.
A model whose synchronized calls change from step to step makes the replay disagree with the others' calls,
and every rank raises :class:`distsync.SyncMismatchError`, decided from the reduced values of the call
where they first differ. The layers' collectives run on a process group of their own (the same ranks). A
joined rank makes each step's two sequences of collectives on two threads: the replay, and DDP's join hook
(the collectives the others make before their forward and at the end of their backward), each on its own
group. The joinable takes DDP's hook over for that: the hook ``Join`` gets from the DDP model is inert, and
the joinable's own hook runs DDP's on a thread next to the replay. So a replay that fails raises at once on
the joined rank; DDP's hook, left waiting for gradient all-reduces that the others, who raised too, never
make, is abandoned on its thread (its collective ends with the group: when the others exit or time out).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from . import batchnorm
from .batchnorm import DistSyncBatchNorm
from .errors import SyncMismatchError

__all__ = ["joinable"]


class _Forward(NamedTuple):
    layer: weakref.ref
    shape: tuple[int, ...]  # the input's shape past the batch dimension
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool  # only then does the call's backward communicate


class _Backward(NamedTuple):
    forward: int  # which forward call of the step this backward call belongs to


class _SyncedLayersJoinable(Joinable):
    """The synchronized layers of one model, as a ``Joinable`` (see :func:`joinable`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = model
        layers = [m for m in model.modules() if isinstance(m, DistSyncBatchNorm)]
        self._layers = weakref.WeakSet(layers)
        # Layers on the default group use one of their own (the same ranks, apart from DDP's collectives;
        # made here, on every rank) inside the Join only: outside it the model holds no group object, so it
        # deep-copies and pickles as before.
        self._on_default = weakref.WeakSet(layer for layer in layers if layer.process_group is None)
        self._group = dist.new_group() if len(self._on_default) else None
        self._steps: list[Any] = []  # the synchronized calls of this rank's step so far
        self._last_step: list[Any] = []  # those of its last finished step
        self._replaying = False
        self._replayed: list[Tensor] = []
        # DDP's join hook, taken over when the same Join asks both for theirs (see _ddp_join_hook)
        self._ddp_own_join_hook = None
        self._handoff: _ReplayHook | None = None
        if isinstance(model, DistributedDataParallel):
            self._ddp_own_join_hook = model.join_hook
            model.join_hook = self._ddp_join_hook  # this instance only; DDP's own join() is unaffected
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
        hook = _ReplayHook(self)
        self._handoff = hook  # Join asks the DDP model for its hook next: it goes to this one
        return hook

    def _ddp_join_hook(self, **kwargs) -> JoinHook:
        """The DDP model's ``join_hook``: DDP's own hook, handed to this joinable's hook when the same
        ``Join`` made that one just before (this joinable comes first), and an inert one in its place."""
        hook = self._ddp_own_join_hook(**kwargs)
        replay, self._handoff = self._handoff, None
        if replay is None:  # a Join without this joinable (ddp.join(), Join([ddp])): DDP's hook as it is
            return hook
        replay.shadow = hook
        return _InertHook()

    def _new_step(self, module, args) -> None:
        config = self._join_config
        if config.enable and not config.is_first_joinable:  # the same Join on every rank: all raise here
            raise ValueError(
                "distsync.joinable must come first in Join: Join([distsync.joinable(ddp_model), ddp_model]). "
                "A joined rank starts replaying the synchronized layers' calls before DDP's join hook waits "
                "for the others' gradient all-reduces"
            )
        self._handoff = None
        if config.enable and self._ddp_own_join_hook is not None and not self._model._join_config.enable:
            raise ValueError(
                "distsync.joinable needs the DDP model in the same Join: "
                "Join([distsync.joinable(ddp_model), ddp_model])"
            )
        if config.enable:
            self.use_own_group(True)
        work = Join.notify_join_context(self)  # the first joinable's "not joined yet" all-reduce
        if work is not None and hasattr(self._model, "reducer"):  # what DDP does with it when it is first
            self._model.reducer._set_forward_pass_work_handle(work, self._model._divide_by_initial_world_size)
        if self._steps:
            self._last_step, self._steps = self._steps, []

    def use_own_group(self, inside: bool) -> None:
        """Put the layers that sync over the default group on the joinable's own group, or back."""
        for layer in self._on_default:
            layer.process_group = self._group if inside else None

    def _observe(self, layer: DistSyncBatchNorm, input: Tensor, output: Tensor | None) -> None:
        if layer not in self._layers or output is None:
            return
        if self._replaying:
            self._replayed.append(output)
            return
        index = len([e for e in self._steps if isinstance(e, _Forward)])
        shape = tuple(input.shape[1:])
        event = _Forward(weakref.ref(layer), shape, input.dtype, input.device, input.requires_grad)
        self._steps.append(event)
        if output.grad_fn is not None and input.requires_grad:
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
        empty = torch.zeros((0, *event.shape), dtype=event.dtype, device=event.device)
        empty.requires_grad_(event.requires_grad)
        layer(empty)


class _ReplayHook(JoinHook):
    """Each step of the others, on a joined rank: the replay of the synchronized calls and DDP's join hook
    (``shadow``), each on a thread of its own. DDP's hook makes the collectives the others make before and
    after their synchronized calls (bucket rebuilds, buffer broadcasts, gradient all-reduces); each of the
    two sequences must meet the others' as they come, on its own process group, so neither may wait for
    the other. The main thread waits for both, and raises a failed replay's error at once."""

    def __init__(self, joinable: _SyncedLayersJoinable) -> None:
        self._joinable = joinable
        self.shadow: JoinHook | None = None

    def main_hook(self) -> None:
        replay = _Worker(self._joinable.replay_step, "distsync-join-replay")
        shadow = None if self.shadow is None else _Worker(self.shadow.main_hook, "distsync-join-ddp")
        _wait(replay, shadow)

    def post_hook(self, is_last_joiner: bool) -> None:
        self._joinable.use_own_group(False)
        if self.shadow is not None:  # DDP's: the last joiner's model is broadcast to every rank
            self.shadow.post_hook(is_last_joiner)


class _InertHook(JoinHook):
    """Stands in ``Join`` for the DDP hook that the joinable's hook runs itself."""


class _Worker:
    """A function on a daemon thread, and how it ended."""

    def __init__(self, fn, name: str) -> None:
        self.error: BaseException | None = None
        self._fn = fn
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as error:  # raised on the main thread by _wait
            self.error = error

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()


def _wait(replay: _Worker, shadow: _Worker | None) -> None:
    """Wait for both threads; a replay that fails is raised at once (DDP's hook, then waiting for gradient
    all-reduces the others never make, is left behind). Each thread's collectives end by their group's
    timeout at the latest, so this wait is bounded too."""
    while True:
        if replay.done and replay.error is not None:
            _raise_replay_error(replay.error)
        if replay.done and (shadow is None or shadow.done):
            if shadow is not None and shadow.error is not None:
                raise shadow.error
            return
        (replay.thread if not replay.done else shadow.thread).join(0.01)


def _raise_replay_error(error: BaseException) -> None:
    if isinstance(error, SyncMismatchError):
        raise SyncMismatchError(
            "this rank has joined (it ran out of batches) and replays the synchronized calls of its last "
            f"step, but the ranks still training changed theirs: {error}"
        ) from error
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
    change between steps makes every rank raise ``SyncMismatchError`` at once, the joined ones included.
    For that, the joinable runs the DDP model's join hook itself, next to the replay, whenever both are in
    the same ``Join``: ``ddp_model.join_hook`` then hands ``Join`` an inert hook (anywhere else, such as
    ``ddp_model.join()``, it is DDP's own).

    Args:
        model: the DDP-wrapped model (or the model itself), whose forward starts each step
    """
    return _SyncedLayersJoinable(model)
