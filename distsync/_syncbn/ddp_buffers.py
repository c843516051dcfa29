"""DDP's buffer broadcast leaves the synchronized layers' running statistics alone.

By default ``DistributedDataParallel`` broadcasts rank 0's buffers before each forward (``broadcast_buffers``,
``forward_sync_buffers`` from torch 2.13). A synchronized layer's running statistics are its group's, the same
on every rank of the group by construction, so for them the broadcast does nothing useful and does harm: it
is a collective on DDP's group between two synchronized calls, so a rank that makes one synchronized call
more than the others meets the others' broadcast with its all-reduce and every rank waits for the collective
timeout instead of raising ``SyncMismatchError``; and with groups smaller than DDP's it hands every group
rank 0's statistics. So the ``running_mean``, ``running_var`` and ``num_batches_tracked`` of every
synchronized layer leave the broadcast of a DDP model calling it, whatever the size of its group: a layer
alone in its group (``process_group`` of one rank, a node of one worker) keeps its own rank's statistics, as
a layer of any other group keeps its group's, and as ``nn.BatchNorm`` does under ``broadcast_buffers=False``.
Which buffers leave depends on the model alone, the same on every rank (DDP requires the same model on all):
were it the size of this rank's group, the rank alone in its group would keep in its broadcast the buffers
its peers leave out, and the broadcast of different buffer lists would hang every rank.

They leave from a layer's first training call under a process group (a synchronized call, or a local one for
a layer alone in its group) if a DDP model is calling it then (a layer resolves its identity once: a model
called before it is wrapped is not seen), or from ``Join``, for the model given to :func:`distsync.joinable`.
Nothing global is registered: the DDP object found calling the layer is told, by name, as torch's own
``_ddp_params_and_buffers_to_ignore`` would have told it at construction. Every other buffer is broadcast as
before, and so is everything at construction, where DDP gives every rank rank 0's model (a checkpoint loaded
on rank 0 only).
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distsync import _torch_compat
from distsync._syncbn.payload import SyncState

__all__ = ["leave_out_of_broadcast"]

_RUNNING = ("running_mean", "running_var", "num_batches_tracked")

# id(DDP model) -> (a weak reference that forgets the entry with the model, ids of the layers left out)
_left_out: dict[int, tuple[weakref.ref, frozenset[int]]] = {}


def leave_out_of_broadcast(ddp: DistributedDataParallel, layer: nn.Module | None = None) -> None:
    """Leave the running statistics of every synchronized layer under ``ddp``, whatever its group, out of its
    buffer broadcast (at once, unless ``layer`` is known to have been left out already). The same on every
    rank: it depends on the model only."""
    key = id(ddp)
    entry = _left_out.get(key)
    if entry is not None and entry[0]() is ddp and (layer is None or id(layer) in entry[1]):
        return
    names, layers = set(), set()
    for path, module in ddp.module.named_modules():
        if isinstance(getattr(module, "_sync_state", None), SyncState):
            layers.add(id(module))
            names.update(
                f"{path}.{name}" if path else name
                for name in _RUNNING
                if module._buffers.get(name) is not None
            )
    _torch_compat.leave_out_of_ddp_buffer_sync(ddp, names)
    _left_out[key] = (weakref.ref(ddp, lambda _, key=key: _left_out.pop(key, None)), frozenset(layers))
