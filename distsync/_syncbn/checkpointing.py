"""The statistics of a checkpointed region's synchronized calls, handed to its recomputation by order.

``torch.utils.checkpoint`` (reentrant or not) runs a region's forward again during backward, to rebuild
what it did not keep. A synchronized call in it would all-reduce a second time, around a merge shift that
has moved since (other rounding: not the tensors the original forward made), and move its running
statistics twice. Instead, each synchronized call of a region's forward is logged on torch's own object for
that region (the reentrant ``CheckpointFunction``'s ``ctx``, the non-reentrant checkpoint's frame object),
in order; the recomputation of that region, which is the same object, takes the k-th logged call's
statistics for its k-th synchronized call (checkpoint itself matches saved tensors the same way): the same
output, bit for bit, no collective, no second update. Every rank recomputes the same regions alike, so
all of them skip the collectives alike. The identity cannot collide: it is the region, not the data.

A region is found from the calling frames of ``torch/utils/checkpoint.py`` (the only place where both the
region's forward and its recomputation are visible), by
:func:`distsync._torch_compat.checkpoint_regions_on_stack`, which reads torch's frames only. Nested regions
log a call in every region around it; a recomputation takes its calls from the innermost region being
recomputed. A forward run inside a backward outside any checkpoint (a reversible network's custom backward)
is an ordinary call: it all-reduces and moves the running statistics, as ``nn.SyncBatchNorm`` and
``nn.BatchNorm`` do. Should torch's checkpoint internals change so that a region is not found, a recomputed
call is an ordinary call too (right, as ``nn.SyncBatchNorm`` is, not bit-identical) and
``tests/test_private_apis.py`` fails.

Selective activation checkpointing (``create_selective_checkpoint_contexts``) adds a ``TorchDispatchMode``
that records each op of the region's forward and, in the recomputation, hands back the outputs of the ops
its policy saved and expects every other op again, in the same order. A synchronized call's ops are not the
same twice by design: the forward packs and all-reduces a payload and moves the running statistics in place
(tensors it caches are mutated afterwards), the recomputation normalizes with the logged statistics. So a
synchronized call runs unseen by those modes (:func:`outside_selective`) in both: they cache none of it and
expect none of it, and its output is made the way it is without them, the same bits. With nobody to sync
with, a recomputed call is batch norm of the same input again, on copies of the running statistics (they
move once, as without checkpointing; ``nn.BatchNorm`` moves them twice unless a policy saves its op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor

from distsync import _torch_compat
from distsync._syncbn.payload import Stats

__all__ = ["OUTSIDE", "CheckpointError", "Regions", "copies", "outside_selective", "regions", "replaying"]

# Selective activation checkpointing's modes: recording the forward's ops, replaying them (2.4 to 2.14)
_SELECTIVE = tuple(
    mode
    for mode in (
        getattr(torch_checkpoint, "_CachingTorchDispatchMode", None),
        getattr(torch_checkpoint, "_CachedTorchDispatchMode", None),
    )
    if isinstance(mode, type)
)


class CheckpointError(RuntimeError):
    """A region's recomputation made other synchronized calls than its forward."""


class _Logged(NamedTuple):
    state: object  # the layer's SyncState: which layer made the call
    shape: tuple[int, ...]
    stats: Stats


class Regions(NamedTuple):
    """Where a synchronized call stands with respect to activation checkpointing."""

    replaying: object | None  # the region being recomputed, whose logged call this one repeats
    logging: tuple  # the regions whose forward this call belongs to (innermost first)

    def replay(self, state, input: Tensor) -> Stats:
        """The statistics of the original of this recomputed call (a copy: normalizing may work on the
        rows in place)."""
        region = self.replaying
        calls = _attribute(region, "_distsync_calls", list)
        counters = _attribute(region, "_distsync_replayed", dict)
        task = _torch_compat.graph_task_id()
        index = counters.get(task, 0)
        counters[task] = index + 1
        if index >= len(calls) or calls[index].state is not state or calls[index].shape != tuple(input.shape):
            raise CheckpointError(
                f"the recomputation of a checkpointed region made synchronized call #{index} differently "
                f"from its forward ({len(calls)} calls): the region must run the same code on the same "
                "inputs when torch.utils.checkpoint recomputes it"
            )
        stats = calls[index].stats
        return Stats.of(stats.rows.clone(), stats.count)

    def log(self, state, input: Tensor, stats: Stats) -> None:
        """Keep this call's statistics on every region whose forward it belongs to (nothing changes them
        after the call: the kernels normalize with copies)."""
        for region in self.logging:
            _attribute(region, "_distsync_calls", list).append(_Logged(state, tuple(input.shape), stats))


def _attribute(region, name: str, make):
    """An attribute distsync keeps on torch's object for a region (dies with it)."""
    value = getattr(region, name, None)
    if value is None:
        value = make()
        setattr(region, name, value)
    return value


OUTSIDE = Regions(None, ())


def regions() -> Regions:
    """The checkpoint regions of the current call, from torch's checkpoint frames
    (:func:`distsync._torch_compat.checkpoint_regions_on_stack`)."""
    if torch.compiler.is_compiling():  # compiled code recomputes under its own rules (nothing is kept)
        return OUTSIDE
    found = _torch_compat.checkpoint_regions_on_stack()
    if not found:
        return OUTSIDE
    replaying = found[-1][0] if found[-1][1] else None
    logging = [region for region, recomputing in found if not recomputing]
    if replaying is None and not logging:
        return OUTSIDE
    return Regions(replaying, tuple(logging))


def replaying() -> bool:
    """Whether the current call repeats a checkpointed region's call (a recomputation, which runs in a
    backward pass: elsewhere no frame is looked at)."""
    if torch.compiler.is_compiling() or _torch_compat.graph_task_id() == -1:
        return False  # compiled code recomputes under its own rules, as regions() says
    return regions().replaying is not None


def outside_selective(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` unseen by selective activation checkpointing's dispatch modes (other modes still see
    it): for distsync's own ops of a synchronized call, which differ between a region's forward and its
    recomputation by design."""
    if torch.compiler.is_compiling() or not _torch_compat.dispatch_modes_active():
        return fn(*args)
    with _torch_compat.without_dispatch_modes(_is_selective):
        return fn(*args)


def copies(running: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """Copies of running statistics for a recomputed training call with nobody to sync with: batch norm
    makes the same output from the same input, and the statistics themselves move once, as without
    checkpointing."""
    return tuple(None if buffer is None else buffer.clone() for buffer in running)


def _is_selective(mode: object) -> bool:
    return isinstance(mode, _SELECTIVE)
