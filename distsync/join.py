"""Uneven numbers of batches per rank: synchronized layers under DDP's ``Join`` context manager.

``torch.distributed.algorithms.join.Join`` lets ranks that ran out of data shadow the collectives of the
ranks still training, so that nobody hangs: DDP's join hook shadows its gradient all-reduces. Synchronized
batch norm has collectives of its own in every forward and backward. A rank that joined shadows those
**collectives**, not the modules: no user code runs on it. While some rank of a layer group has joined,
the ranks still training announce each synchronized call just before its all-reduce (one small all-reduce:
which layer, its width, dtype, momentum, direction), and the end of each step; the joined rank takes part
in each call with no samples and moves its own running statistics from the reduced values, so it keeps
following the others. So each step equals ``nn.BatchNorm`` on the batches that exist that step, whatever
the step's calls are: activation checkpointing, batch-norm subclasses, forward hooks, calls that change
from step to step or a rank that never had a batch need nothing special.

The protocol, on the layers' process group (a group of its own for layers on the default group, so that it
never interleaves with DDP's collectives, which a joined rank shadows on another thread):

* every step starts with ``Join``'s all-reduce of the ranks still training (the joinable's, as it comes
  first); when some rank has joined, a roll call tells each layer group whether one of its ranks has;
* a training rank in such a group announces each synchronized call, forward or backward, before its
  all-reduce, and the end of the step: after the backward of the model's outputs (a callback at the end of
  that backward pass), or after the forward when no output needs a gradient. As DDP's own join hook does,
  this takes a step to be one forward of the model and at most one backward of its outputs;
* the joined rank, once per step of the others, answers the roll call, then takes part in the announced
  calls until the end of the step, next to DDP's join hook (on a thread of its own).

Without a joined rank the collectives of a step are those of training outside ``Join``. Announcements are
all-reduced with MAX (the joined ranks send -inf), so floats arrive exactly as sent. A call names its layer
by its place among the joinable's layers (and its identity, checked), so separately converted models with
the same paths are told apart, and the running statistics it moves by their place among the layer's
buffers, so a subclass normalizing with buffers of its own (a second set of statistics) is followed
exactly; what a converted subclass's forward counts itself (``num_batches_tracked``, counters of its own)
is announced before its next call and at the end of the step, by how much each counter moved.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from distsync import _torch_compat, batchnorm
from distsync._syncbn.ddp_buffers import leave_out_of_broadcast
from distsync._syncbn.identity import resolve, stamp_paths
from distsync._syncbn.payload import BACKWARD, FORWARD, Call, ProcessGroupReducer
from distsync._syncbn.subclass import original_class
from distsync.batchnorm import DistSyncBatchNorm
from distsync.errors import SyncError, SyncMismatchError
from distsync.functional import shadow_backward, shadow_forward

__all__ = ["joinable"]

# Announcement: [kind, layer id (4 x 16 bits), layer's place, then by kind:
#   FORWARD, BACKWARD: channels, dtype, has momentum, momentum, eps, running_mean's and running_var's
#     places among the layer's buffers (-1: none), counts num_batches_tracked
#   _COUNTED: a counter's place among the layer's buffers, by how much the layer's forward moved it
#   _REFUSED: why the ranks still training raise (_OUTSIDE, _NOT_BUFFERS)]
_END, _COUNTED, _REFUSED = 3.0, 4.0, 5.0
_OUTSIDE, _NOT_BUFFERS = 1.0, 2.0
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = 14

# The joinable armed for each model (by id): a new Join on the same model disarms the one before.
_armed: dict[int, weakref.ref] = {}


_join_groups: list[tuple[Any, dist.ProcessGroup]] = []  # (the default group, its join group)


def _join_group() -> dist.ProcessGroup:
    """The process group of the layers on the default group inside ``Join``: the same ranks, apart from
    DDP's collectives (made once per default group, on every rank, at the first joinable)."""
    world = dist.group.WORLD
    for default, group in _join_groups:
        if default is world:
            return group
    group = dist.new_group()
    _join_groups.append((world, group))
    return group


class _SyncedLayersJoinable(Joinable):
    """The synchronized layers of a model (and of the modules given with it), as a ``Joinable`` (see
    :func:`joinable`)."""

    def __init__(self, model: nn.Module, others: tuple[nn.Module, ...] = ()) -> None:
        super().__init__()
        self._model = model
        self._others = others
        self._layers: list[DistSyncBatchNorm] = []
        seen: set[int] = set()
        for module in (model, *others):
            for layer in module.modules():
                if isinstance(layer, DistSyncBatchNorm) and id(layer) not in seen:
                    seen.add(id(layer))
                    self._layers.append(layer)
            if module is model:
                self._model_layers = len(self._layers)  # the others' layers come after
        groups = {id(layer.process_group): layer.process_group for layer in self._layers}
        if len(groups) > 1:
            raise ValueError(
                "distsync.joinable: the synchronized layers of one joinable must share one process group "
                f"under Join; these use {len(groups)}"
            )
        group = next(iter(groups.values()), None)
        if group is None or group is dist.group.WORLD:  # apart from DDP's collectives, made on every rank
            group = _join_group()
        self._reducer = _AnnouncingReducer(group, self)
        self._hooks: list[Any] = []
        self._ddp_own_join_hook = None  # DDP's join hook, taken over while armed (see _ddp_join_hook)
        self._handoff: _ShadowHook | None = None
        self._end_due = False  # this rank announced calls of the current step: it owes the others its end
        self._end_queued = False
        self._stepping = False  # from the model's forward to the end of the step
        self._places: dict[int, int] = {}  # id(layer's SyncState) -> the layer's place in self._layers
        # Converted subclasses count in their own forward: their counters as last announced, by place
        self._counted: dict[int, list[tuple[int, Tensor, int]]] = {}
        self.announcing = False  # a rank of the layers' group has joined: announce every call

    @property
    def join_device(self) -> torch.device:
        return self._model.join_device if hasattr(self._model, "join_device") else _device_of(self._model)

    @property
    def join_process_group(self) -> Any:
        if hasattr(self._model, "join_process_group"):
            return self._model.join_process_group
        return dist.group.WORLD

    # -------------------------------------------------------------------------------- arming

    def join_hook(self, **kwargs) -> JoinHook:
        """Called by ``Join`` as it is made: the layers sync on the join group until its post-hook."""
        self._arm()
        hook = _ShadowHook(self)
        self._handoff = hook  # Join asks the DDP model for its hook next: it goes to this one
        return hook

    def _arm(self) -> None:
        previous = _armed.get(id(self._model))
        if previous is not None and previous() is not None and previous() is not self:
            previous()._disarm()  # a Join left by an exception never ran its post-hooks
        _armed[id(self._model)] = weakref.ref(self)
        if self._hooks:
            return
        for module in (self._model, *self._others):
            stamp_paths(module, only_missing=True)
        for layer in self._layers:
            state = layer._sync_state
            if state.identity is None:
                resolve(layer, layer.num_features)
            state.join = self._reducer
        self._places = {id(layer._sync_state): place for place, layer in enumerate(self._layers)}

        def new_step(module, args):
            self._new_step(module, args)

        def forward_done(module, args, output):
            self._forward_done(module, args, output)

        self._hooks = [  # eager even in a compiled model: collectives and their results, once per step
            self._model.register_forward_pre_hook(_torch_compat.disable_dynamo(new_step)),
            self._model.register_forward_hook(_torch_compat.disable_dynamo(forward_done)),
        ]
        batchnorm._outside_join.append(self._refuse_outside)
        if isinstance(self._model, DistributedDataParallel):
            leave_out_of_broadcast(self._model)  # on every rank, a rank that joined at once included
            self._ddp_own_join_hook = self._model.join_hook
            self._model.join_hook = self._ddp_join_hook  # this instance only, until disarmed

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self._hooks:
            batchnorm._outside_join.remove(self._refuse_outside)
        self._hooks = []
        for layer in self._layers:
            if layer._sync_state.join is self._reducer:
                layer._sync_state.join = None
        if self._ddp_own_join_hook is not None:
            del self._model.join_hook  # DDP's own method again
            self._ddp_own_join_hook = None
        self.announcing = self._end_due = self._stepping = False
        self._counted.clear()
        if _armed.get(id(self._model)) is not None and _armed[id(self._model)]() is self:
            del _armed[id(self._model)]

    def _ddp_join_hook(self, **kwargs) -> JoinHook:
        """The DDP model's ``join_hook`` while armed: DDP's own hook, handed to this joinable's hook when the
        same ``Join`` made that one just before (this joinable comes first), and an inert one in its place."""
        hook = self._ddp_own_join_hook(**kwargs)
        shadow, self._handoff = self._handoff, None
        if shadow is None:  # a Join without this joinable (ddp.join(), Join([ddp])): DDP's hook as it is
            return hook
        shadow.ddp = hook
        return _InertHook()

    # ---------------------------------------------------------------------- a training rank's step

    def _new_step(self, module, args) -> None:
        config = self._join_config
        if config.enable and not config.is_first_joinable:  # the same Join on every rank: all raise here
            raise ValueError(
                "distsync.joinable must come first in Join: Join([distsync.joinable(ddp_model), ddp_model]). "
                "Its all-reduce of the ranks still training tells the layers whether to announce their calls"
            )
        self._handoff = None
        if config.enable and self._ddp_own_join_hook is not None and not self._model._join_config.enable:
            raise ValueError(
                "distsync.joinable needs the DDP model in the same Join: "
                "Join([distsync.joinable(ddp_model), ddp_model])"
            )
        self.end_step()  # a step without a backward pass: its end was not said yet
        self._stepping = True
        work = Join.notify_join_context(self)  # the first joinable's "not joined yet" all-reduce
        if work is None:
            return
        if hasattr(self._model, "reducer"):  # what DDP does with it when it is the first joinable
            _torch_compat.give_ddp_join_count(self._model, work)
        training = int(work.get_future().wait()[0].item())
        self.announcing = False
        if training < dist.get_world_size(self.join_process_group):  # some rank joined: a roll call
            present = self._reducer.roll_call(1.0)
            self.announcing = present < self._reducer.world_size
        self._counted = {  # what the subclasses' own forwards count from here on is announced
            place: [(i, b, int(b)) for i, b in enumerate(layer.buffers()) if _counter(b)]
            for place, layer in enumerate(self._layers)
            if self.announcing and original_class(type(layer)) is not None
        }

    def _forward_done(self, module, args, output) -> None:
        self._end_due = self.announcing
        needing = [t for t in _tensors(output) if t.requires_grad]
        if not needing:
            self.end_step()
            return
        self._end_queued = False
        for tensor in needing:
            tensor.register_hook(self._queue_end)

    def _queue_end(self, grad: Tensor) -> None:
        if self._stepping and not self._end_queued:
            self._end_queued = True
            _torch_compat.at_end_of_backward(self.end_step)

    def end_step(self) -> None:
        """The step is over: tell the joined ranks its calls are (once per step that announced)."""
        self._stepping = False
        if self._end_due:
            self._end_due = False
            for place in self._counted:
                self.announce_counted(place)
            self._reducer.announce_end()

    def check_in_step(self, state) -> None:
        """Before a call of a layer of the other modules: it must come in a step (after the model's forward,
        before the end of its backward), where the ranks that joined listen. Raised on every rank still
        training (all of them make the call), whether or not a rank has joined yet."""
        place = self._places.get(id(state), 0)
        if place >= self._model_layers and not self._stepping:
            raise ValueError(
                f"distsync.joinable: {self._layers[place]._layer_name()}, of a module given to "
                "distsync.joinable besides the model, is called outside a step; call it after the model's "
                "forward (in the loss), before the end of its backward"
            )

    def before_call(self, state) -> tuple[int, DistSyncBatchNorm]:
        """Before an announced call of the layer whose sync state is ``state``: its place among this
        joinable's layers and the layer, once what its forward counted so far is announced."""
        place = self._places[id(state)]
        self.announce_counted(place)
        return place, self._layers[place]

    def announce_counted(self, place: int) -> None:
        """Say how far the counters of the converted subclass at ``place`` moved since last said (its own
        forward counts ``num_batches_tracked``, or not, and counters of its own): before each of its calls
        and at the end of the step, so the joined ranks' counters follow whatever the forward does."""
        counted = self._counted.get(place)
        if not counted:
            return
        layer = self._layers[place]
        for k, (index, buffer, value) in enumerate(counted):
            now = int(buffer)
            if now != value:
                self._reducer.announce_counted(layer, place, index, now - value)
                counted[k] = (index, buffer, now)

    def _refuse_outside(self, layer: DistSyncBatchNorm) -> None:
        """Before a synchronized call of ``layer``, in none of the armed joinables: raise during a step (a
        rank that joined could not take part), on every rank still training and, announced, the others."""
        if not self._stepping:
            return
        state = layer._sync_state
        if state.identity is None:
            resolve(layer, layer.num_features)
        callers = _torch_compat.modules_being_called()  # outermost first
        holder = next((m for m in callers if m is not layer and any(x is layer for x in m.modules())), None)
        holding = (
            "the module that holds it" if holder is None else f"the {type(holder).__name__} that holds it"
        )
        message = (
            f"distsync.joinable: the synchronized layer {layer._layer_name()} is called in a step under Join "
            "but is not in the modules given to distsync.joinable, so a rank that joined could not take part "
            f"in its calls. Pass {holding} too, on every rank: Join([distsync.joinable(ddp_model, "
            "criterion), ddp_model])"
        )
        if self.announcing:
            self._reducer.announce_refusal(_OUTSIDE)
        raise ValueError(message)

    # ------------------------------------------------------------------------- a joined rank

    def shadow_step(self) -> None:
        """Take part, with no samples, in the synchronized calls of one step of the ranks still training."""
        if self._reducer.roll_call(0.0) == 0:
            return  # nobody of this layer group is training: no call to take part in
        device = self.join_device
        while True:
            kind, fields = self._reducer.receive()
            if kind == _END:
                return
            if kind == _REFUSED:
                raise SyncError(_refusal(fields[6]))
            layer = self._layer(kind, fields)
            if kind == _COUNTED:
                with torch.no_grad():
                    list(layer.buffers())[int(fields[6])].add_(int(fields[7]))
            elif kind == FORWARD:
                shadow_forward(layer, self._decode(layer, kind, fields), self._reducer.plain, device)
            else:
                shadow_backward(self._decode(layer, kind, fields), self._reducer.plain, device)

    def _layer(self, kind: float, fields: list[float]) -> DistSyncBatchNorm:
        """The layer an announcement names, checked against this rank's (same place, same identity)."""
        identity = sum(int(fields[1 + i]) << (16 * i) for i in range(4))
        place = int(fields[5])
        layer = self._layers[place] if 0 <= place < len(self._layers) else None
        if (
            layer is None
            or layer._sync_state.identity != identity
            or kind not in (FORWARD, BACKWARD, _COUNTED)
        ):
            raise SyncMismatchError(
                "this rank has joined (it ran out of batches) and takes part in the others' synchronized "
                f"calls, but they announced a call it cannot make: layer id {identity:#x} is not "
                f"synchronized layer #{place} of the modules given to distsync.joinable on this rank"
            )
        return layer

    def _decode(self, layer: DistSyncBatchNorm, kind: float, fields: list[float]) -> Call:
        momentum = fields[9] if fields[8] else None
        buffers = list(layer.buffers())
        mean, var = (buffers[int(i)] if i >= 0 else None for i in (fields[11], fields[12]))
        return Call(
            int(kind), layer._sync_state, int(fields[6]), _DTYPES[int(fields[7])], momentum, fields[10], mean,
            var, bool(fields[13]),
        )  # fmt: skip


class _AnnouncingReducer(ProcessGroupReducer):
    """The layers' reducer inside ``Join``: one all-reduce on the join group per call, announced first
    while some rank of the group has joined."""

    def __init__(self, group: dist.ProcessGroup, joinable: _SyncedLayersJoinable) -> None:
        super().__init__(group, dist.get_world_size(group))
        self.plain = ProcessGroupReducer(group, self.world_size)
        self._joinable = weakref.ref(joinable)

    def announce(self, call: Call) -> None:
        joinable = self._joinable()
        if joinable is None:
            return
        joinable.check_in_step(call.state)
        if not joinable.announcing:
            return
        place, layer = joinable.before_call(call.state)
        running = [_place_among_buffers(layer, buffer) for buffer in (call.running_mean, call.running_var)]
        if None in running:  # every rank still training makes this call: all of them get here
            self.announce_refusal(_NOT_BUFFERS)
            raise ValueError(_refusal(_NOT_BUFFERS, layer._layer_name()))
        fields = [
            float(call.direction),
            *_layer_fields(call.state.identity, place),
            float(call.channels),
            float(_DTYPES.index(call.dtype)) if call.dtype in _DTYPES else 2.0,
            1.0 if call.momentum is not None else 0.0,
            float(call.momentum or 0.0),
            float(call.eps),
            *map(float, running),
            float(call.counts),
        ]
        self._send(fields)

    def announce_counted(self, layer: DistSyncBatchNorm, place: int, index: int, moved: int) -> None:
        """A converted subclass's forward moved its counter (buffer) ``index`` by ``moved``."""
        self._send([_COUNTED, *_layer_fields(layer._sync_state.identity, place), float(index), float(moved)])

    def announce_refusal(self, reason: float) -> None:
        self._send([_REFUSED, 0.0, 0.0, 0.0, 0.0, 0.0, reason])

    def announce_end(self) -> None:
        self._send([_END])

    def _send(self, fields: list[float]) -> None:
        fields = fields + [0.0] * (_FIELDS - len(fields))
        dist.all_reduce(torch.tensor(fields, dtype=torch.float64, device=_device(self.process_group)),
                        op=dist.ReduceOp.MAX, group=self.process_group)  # fmt: skip

    def receive(self) -> tuple[float, list[float]]:
        """The next announcement of the ranks still training (a joined rank sends -inf)."""
        fields = torch.full((_FIELDS,), -math.inf, dtype=torch.float64, device=_device(self.process_group))
        dist.all_reduce(fields, op=dist.ReduceOp.MAX, group=self.process_group)
        values = fields.tolist()
        return values[0], values

    def roll_call(self, present: float) -> int:
        """How many ranks of the group are still training (each training rank sends 1, a joined one 0)."""
        count = torch.tensor([present], dtype=torch.float64, device=_device(self.process_group))
        dist.all_reduce(count, group=self.process_group)
        return int(count.item())


def _layer_fields(identity: int | None, place: int) -> list[float]:
    identity = identity or 0
    return [*(float((identity >> (16 * i)) & 0xFFFF) for i in range(4)), float(place)]


def _place_among_buffers(layer: nn.Module, buffer: Tensor | None) -> int | None:
    """Where ``buffer`` is among ``layer.buffers()`` (-1 for no buffer; None if it is none of them)."""
    if buffer is None:
        return -1
    return next((i for i, own in enumerate(layer.buffers()) if own is buffer), None)


def _counter(buffer: Tensor) -> bool:
    """A buffer a subclass may count with: an integer scalar."""
    return buffer.numel() == 1 and not buffer.is_floating_point() and buffer.dtype != torch.bool


def _refusal(reason: float, layer_name: str = "a synchronized layer") -> str:
    if reason == _OUTSIDE:
        return (
            "distsync.joinable: the ranks still training called a synchronized layer that is not in the "
            "modules given to distsync.joinable (see their error); pass the module that holds it too"
        )
    return (
        f"distsync.joinable: {layer_name} normalized with running statistics that are not buffers of the "
        "layer, which a rank that joined cannot follow: register them as buffers of the layer"
    )


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _ShadowHook(JoinHook):
    """Each step of the others, on a joined rank: taking part in the synchronized calls, next to DDP's join
    hook (``ddp``), each on a thread of its own. DDP's hook makes the collectives the others make before and
    after their synchronized calls (bucket rebuilds, buffer broadcasts, gradient all-reduces); each of the
    two sequences must meet the others' as they come, on its own process group, so neither may wait for
    the other. The main thread waits for both, and raises a failure of the first at once."""

    def __init__(self, joinable: _SyncedLayersJoinable) -> None:
        self._joinable = joinable
        self.ddp: JoinHook | None = None

    def main_hook(self) -> None:
        shadow = _Worker(self._joinable.shadow_step, "distsync-join-shadow")
        ddp = None if self.ddp is None else _Worker(self.ddp.main_hook, "distsync-join-ddp")
        _wait(shadow, ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        self._joinable._disarm()
        if self.ddp is not None:  # DDP's: the last joiner's model is broadcast to every rank
            self.ddp.post_hook(is_last_joiner)


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


def _wait(shadow: _Worker, ddp: _Worker | None) -> None:
    """Wait for both threads; a failed shadow is raised at once (DDP's hook, then waiting for gradient
    all-reduces the others never make, is left behind). Each thread's collectives end by their group's
    timeout at the latest, so this wait is bounded too."""
    while True:
        if shadow.done and shadow.error is not None:
            raise shadow.error
        if shadow.done and (ddp is None or ddp.done):
            if ddp is not None and ddp.error is not None:
                raise ddp.error
            return
        (shadow.thread if not shadow.done else ddp.thread).join(0.01)


def _tensors(value, seen: set[int] | None = None) -> list[Tensor]:
    """The tensors in a model's output, found where DDP looks for them: nested lists, tuples, the values of
    any dict (an ``OrderedDict``, a Hugging Face ``ModelOutput``) and the fields of dataclasses."""
    if isinstance(value, Tensor):
        return [value]
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name) for field in dataclasses.fields(value)]
    else:
        return []
    return [t for item in items for t in _tensors(item, seen)]


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def joinable(model: nn.Module, *others: nn.Module) -> Joinable:
    """The synchronized layers of ``model`` as a ``Joinable``, for ranks with uneven numbers of batches.

    Pass it to ``Join`` first, then the DDP model, on every rank (make it once, or anew for each ``Join``)::

        >>> ddp_model = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
        >>> with Join([distsync.joinable(ddp_model), ddp_model]):
        ...     for x, y in loader:  # uneven lengths across ranks, none at all on some
        ...         loss_fn(ddp_model(x), y).backward()
        ...         optimizer.step()

    A rank whose loader ran out takes part in the others' synchronized calls with no samples, so each
    step's outputs, gradients and running statistics are those of ``nn.BatchNorm`` on the batches that exist
    that step, and its own running statistics follow. It runs no module of its own meanwhile: what the
    others' steps call (checkpointed blocks, subclasses, calls that change between steps) needs nothing
    special. Inside the ``Join`` the layers sync on a process group of their own with the same ranks (made
    once per process, on every rank), apart from DDP's collectives. A step is one forward of the model and
    at most one backward of its outputs, as for DDP's own join hook. The joinable runs the DDP model's join
    hook itself, next to its own, whenever both are in the same ``Join``: ``ddp_model.join_hook`` then hands
    ``Join`` an inert hook (anywhere else, such as ``ddp_model.join()``, it is DDP's own).

    A synchronized layer the step calls outside ``model`` (in a loss, a projection head called apart) is
    given after it, by the module that holds it: ``distsync.joinable(ddp_model, criterion)``; it is then
    shadowed like the model's, if called after the model's forward. One that is not given raises
    ``ValueError`` at its first call in a step, naming it, on every rank still training (``SyncError`` on
    the ranks that joined). Separately converted models whose layers have the same paths (two towers) may
    be in one joinable; their calls are told apart by the layer, not only by its path.

    Args:
        model: the DDP-wrapped model (or the model itself), whose forward starts each step
        others: other modules with synchronized layers the step calls after the model's forward
    """
    return _SyncedLayersJoinable(model, others)
