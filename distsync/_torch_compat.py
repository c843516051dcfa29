"""The private torch APIs the synchronized layer uses, each in one place, each with a safe way out.

torch changes private names between releases without notice. Each one distsync relies on lives here,
behind a function that says what it is for, and falls back to a public equivalent (slower or less
informative, never wrong) where the private one is gone. ``tests/test_private_apis.py`` checks every one of
them on the installed release, so a release that changes one fails that named test in CI rather than a
user's run taking the fallback unnoticed.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "at_end_of_backward",
    "checkpoint_regions_on_stack",
    "ddp_ignored",
    "disable_dynamo",
    "dispatch_modes_active",
    "give_ddp_join_count",
    "graph_task_id",
    "leave_out_of_ddp_buffer_sync",
    "mark_constant_for_dynamo",
    "modules_being_called",
    "process_group_timeout",
    "set_ddp_ignored",
    "traceable_all_reduce",
    "traced_as_one_graph",
    "without_dispatch_modes",
]


def disable_dynamo(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, without importing dynamo (seconds) before the first compiled call.

    ``torch._disable_dynamo`` is torch's own lazy form of it (2.1 to 2.14 at least). Where it is gone, the
    public ``torch.compiler.disable`` is applied at the first call, which only happens while compiling."""
    lazy = getattr(torch, "_disable_dynamo", None)
    if lazy is not None:
        return lazy(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return _disabled(fn)(*args, **kwargs)

    return call


@functools.cache
def _disabled(fn: Callable) -> Callable:
    return torch.compiler.disable(fn)


def mark_constant_for_dynamo(fn: Callable) -> Callable:
    """What ``torch._dynamo.assume_constant_result(fn)`` does (it sets this one flag: dynamo then calls
    ``fn`` at trace time and bakes its result into the graph), without importing dynamo."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def traced_as_one_graph() -> bool:
    """Whether the frame dynamo traces now must become one graph (``fullgraph=True``, export,
    ``torch._dynamo.error_on_graph_break``): an exception in the traced code is then raised to the caller,
    and no part of the frame runs eagerly after it. Read at trace time from dynamo's current instruction
    translator (``InstructionTranslator.current_tx()``: ``one_graph`` and ``error_on_graph_break``, 2.11 to
    2.14 at least); False where there is none or it cannot be read."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return False
    return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


def graph_task_id() -> int:
    """The id of the backward pass the current thread runs (-1 outside any): ``torch._C.
    _current_graph_task_id`` (2.1 to 2.14 at least); -1 where it is gone."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else current()


def dispatch_modes_active() -> bool:
    """Whether any ``TorchDispatchMode`` may be active on this thread (``torch._C._len_torch_dispatch_stack``,
    2.0 to 2.14 at least; where it is gone, True: :func:`without_dispatch_modes` then looks)."""
    count = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return True if count is None else count() > 0


@contextlib.contextmanager
def without_dispatch_modes(selected: Callable[[Any], bool]) -> Iterator[None]:
    """Run the block with the dispatch modes ``selected`` picks taken off this thread's stack, the others
    kept in their order, and the stack as it was afterwards: ``torch.utils._python_dispatch``'s
    ``_get_current_dispatch_mode_stack``, ``_pop_mode`` and ``_push_mode`` (2.0 to 2.14 at least; what
    ``TorchDispatchMode.__enter__``/``__exit__`` do). Where they are gone, or a mode above a picked one is
    one of torch's tracing modes (which live apart from the stack), the stack is left alone."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
    except ImportError:
        yield
        return
    stack = _get_current_dispatch_mode_stack()
    lowest = next((i for i, mode in enumerate(stack) if selected(mode)), None)
    if lowest is None or any(_keyed(mode) for mode in stack[lowest:]):
        yield
        return
    above = [_pop_mode() for _ in range(len(stack) - lowest)]  # the top first
    kept = [mode for mode in reversed(above) if not selected(mode)]
    for mode in kept:
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for mode in reversed(above):
            _push_mode(mode)


def _keyed(mode: Any) -> bool:
    """A mode kept apart from the plain stack (fake, proxy, functional, pre-dispatch: torch's tracing)."""
    return any(mode.__dict__.get(key) is not None for key in ("_mode_key", "_dispatch_key")) or any(
        getattr(type(mode), key, None) is not None for key in ("_mode_key", "_dispatch_key")
    )


def process_group_timeout(group: dist.ProcessGroup | None) -> float | None:
    """How long a collective of ``group`` may wait for a peer, in seconds, or None where torch does not
    say (then distsync's own waits use their defaults). Read from the group's backend options, which torch
    keeps private (``_get_backend(device).options._timeout``, 2.0 to 2.14 at least)."""
    group = group or dist.group.WORLD
    try:
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        backend = group._get_backend(device)
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError, TypeError):  # a backend without options (fake, custom)
        return None


def traceable_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``tensor`` over ``group`` as an op ``torch.compile`` traces into its graph:
    ``torch.distributed._functional_collectives.all_reduce`` (2.2 to 2.14 at least; not differentiable
    everywhere: callers write the backward). There is no public traceable collective."""
    from torch.distributed import _functional_collectives

    return _functional_collectives.all_reduce(tensor, "sum", group)


def ddp_ignored(model: torch.nn.Module) -> list[str]:
    """The parameters and buffers of ``model`` a DDP built around it will leave alone (by name)."""
    return list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))


def set_ddp_ignored(model: torch.nn.Module, names: list[str]) -> None:
    """Make a DDP built around ``model`` leave these parameters and buffers alone (no broadcast, no
    gradient all-reduce): ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``, torch's
    own (private) way, which Lightning's and other strategies honour because DDP reads it at construction."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def leave_out_of_ddp_buffer_sync(ddp: DistributedDataParallel, names: set[str]) -> bool:
    """Make a DDP model leave these buffers (names from ``ddp.module``) out of its buffer broadcast before
    each forward and at the end of ``Join``, from its next forward on; its other buffers are broadcast as
    before. Returns whether DDP's buffer list changed.

    DDP keeps the names it leaves alone in ``parameters_to_ignore`` (a set read at construction from the
    module's ``_ddp_params_and_buffers_to_ignore``) and rebuilds its buffer list from it with
    ``_assign_modules_buffers`` (2.0 to 2.14 at least); a buffer name never matches a parameter's, whose
    gradient reduction was fixed at construction. Where that is gone DDP broadcasts as it always did."""
    ignored = getattr(ddp, "parameters_to_ignore", None)
    assign = getattr(ddp, "_assign_modules_buffers", None)
    if not isinstance(ignored, set) or assign is None or names <= ignored:
        return False
    ignored.update(names)
    assign()
    return True


def at_end_of_backward(callback) -> None:
    """Run ``callback`` when the backward pass running now ends (``queue_callback`` of autograd's engine,
    which DDP and FSDP use for their own end of backward; 1.x to 2.14 at least)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def give_ddp_join_count(ddp: DistributedDataParallel, work) -> None:
    """Hand DDP the pending all-reduce of the ranks still training under ``Join``, as DDP's own forward does
    when DDP is the first joinable (its gradients are then averaged over those ranks as DDP decides):
    ``reducer._set_forward_pass_work_handle`` (1.10 to 2.14 at least)."""
    ddp.reducer._set_forward_pass_work_handle(work, ddp._divide_by_initial_world_size)


# ---------------------------------------------------------------------------------------- the frames read
# The only two places where distsync reads interpreter frames: what torch has no API for. Only torch's own
# frames' variables are read, never a caller's: on Python < 3.13 reading a frame's variables keeps a
# snapshot of them in that frame until it returns, and those frames return with the module call or the
# checkpointed region they belong to.

# torch's own frames of a module call (``Module.__call__`` and what it calls): their ``self`` is a module
# being called. ``_wrapped_call_impl`` is ``__call__`` from torch 2.1 on, ``_call_impl`` what it runs.
MODULE_CALL_CODES = frozenset(
    fn.__code__
    for fn in (getattr(nn.Module, name, None) for name in ("_wrapped_call_impl", "_call_impl"))
    if hasattr(fn, "__code__")
)


def modules_being_called() -> list[nn.Module]:
    """The modules being called now (the ``self`` of torch's module-call frames), outermost first, each
    once. torch has no API for the module call stack (forward hooks would be a global registration)."""
    modules, seen = [], set()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in MODULE_CALL_CODES:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and id(module) not in seen:
                seen.add(id(module))
                modules.append(module)
        frame = frame.f_back
    modules.reverse()
    return modules


_CHECKPOINT_FILE = torch_checkpoint.__file__
_REENTRANT = getattr(torch_checkpoint, "CheckpointFunction", None)
REENTRANT_CHECKPOINT_CODES = tuple(
    getattr(getattr(_REENTRANT, name, None), "__code__", None) for name in ("forward", "backward")
)
CHECKPOINT_FRAME_CLASS = getattr(torch_checkpoint, "_CheckpointFrame", None)  # non-reentrant: one per call


def checkpoint_regions_on_stack() -> list[tuple[object, bool]]:
    """``(region, recomputing)`` for each activation-checkpointed region the current call runs in,
    innermost first, up to the first one being recomputed: torch's own object for the region (the
    reentrant ``CheckpointFunction``'s ``ctx``, the non-reentrant checkpoint's ``_CheckpointFrame``) and
    whether this is its recomputation (True) or its forward (False). Read from the frames of
    ``torch/utils/checkpoint.py``, the only place where both the region's forward and its recomputation are
    visible (2.0 to 2.14 at least); where torch's internals change so that none is found, the list is empty
    (a recomputed call is then an ordinary one). Its caller's own frame is skipped (it is distsync's). A
    plain loop, no generator: it runs at every synchronized call."""
    found: list[tuple[object, bool]] = []
    frame = sys._getframe(2)  # the caller's caller: the frame of the synchronized call and those above it
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _CHECKPOINT_FILE:
            if code in REENTRANT_CHECKPOINT_CODES:
                region = (frame.f_locals.get("ctx"), code is REENTRANT_CHECKPOINT_CODES[1])
            elif CHECKPOINT_FRAME_CLASS is not None:
                region = _non_reentrant_region(frame.f_locals)
            else:
                region = None
            if region is not None:
                found.append(region)
                if region[1]:
                    break
        frame = frame.f_back
    return found


def _non_reentrant_region(local: dict) -> tuple[object, bool] | None:
    for value in local.values():
        if isinstance(value, CHECKPOINT_FRAME_CLASS):  # the unpack hook that recomputes the region
            return value, True
        if isinstance(value, types.GeneratorType) and value.gi_frame is not None:  # checkpoint() itself:
            for inner in value.gi_frame.f_locals.values():  # the region's frame object, in its generator
                if isinstance(inner, CHECKPOINT_FRAME_CLASS):
                    return inner, False
    return None
