"""What a synchronized layer's first training call learns from the modules calling it: its identity, the DDP
models whose buffer broadcast leaves its running statistics alone (:mod:`distsync._syncbn.ddp_buffers`,
whatever the size of its group), and whether anything averages its gradients, said once, on every rank.

Synchronized batch norm makes each rank's forward depend on every rank's batch, but it leaves the
parameters' gradients local, as ``nn.SyncBatchNorm`` does: a data-parallel wrapper (DDP, FSDP, DeepSpeed's
engine, ...) averages them. A model whose synced layers train in a group of several ranks without such a
wrapper trains each rank's weights on its own gradients while sharing batch statistics: silently not data
parallel. It happens when a launcher starts the ranks but the training code does not know it (``accelerate
launch`` without the matching ``Accelerator`` settings, a script that forgot DDP). The first training call
that carries gradients looks at the modules being called (torch's module-call frames' ``self``, wrappers'
inner modules followed) for a data-parallel wrapper, once per process, and warns if it finds none.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distsync import _torch_compat
from distsync._syncbn.ddp_buffers import leave_out_of_broadcast
from distsync._syncbn.identity import is_wrapper_slot, resolve

__all__ = ["meet_callers"]

# Classes (and base classes) that average gradients across ranks: torch's DDP and FSDP (1 and 2), and
# those of other libraries, known by name so that none of them is imported.
_DATA_PARALLEL = frozenset(
    {
        "DistributedDataParallel",
        "FullyShardedDataParallel",
        "FSDPModule",
        "ShardedDataParallel",
        "DeepSpeedEngine",
        "DataParallel",
    }
)

_decided = False


def _data_parallel(module: nn.Module) -> bool:
    while True:
        if any(cls.__name__ in _DATA_PARALLEL for cls in type(module).__mro__):
            return True
        slots = (child for name, child in module._modules.items() if is_wrapper_slot(module, name))
        inner = next((child for child in slots if child is not None), None)
        if inner is None:  # torch.compile's _orig_mod (the traced DDP is not a frame), checkpoint wrappers
            return False
        module = inner


def meet_callers(layer: nn.Module, world_size: int) -> None:
    """At the first training call of ``layer`` under a process group, in a group of ``world_size`` ranks (1:
    alone in it): fix its identity, leave its running statistics out of the buffer broadcast of the DDP
    models calling it (whatever the size of its group, so the same on every rank), and warn, once per
    process, if it syncs, the call carries gradients and no module being called is a data-parallel wrapper."""
    resolve(layer, layer.num_features)
    callers = _torch_compat.modules_being_called()
    for module in callers:
        if isinstance(module, DistributedDataParallel):
            leave_out_of_broadcast(module, layer)
    if world_size > 1:
        _warn_if_unwrapped(layer, world_size, callers)


def _warn_if_unwrapped(layer: nn.Module, world_size: int, callers: list[nn.Module]) -> None:
    global _decided
    if _decided or not torch.is_grad_enabled():
        return
    if not any(p.requires_grad for p in layer.parameters(recurse=False)):
        return  # a frozen layer or update_bn: no gradients to average, decide at a later call
    _decided = True
    if any(_data_parallel(module) for module in callers):
        return
    warnings.warn(
        f"distsync: the synchronized layer {layer._sync_state.layer_name or type(layer).__name__} trains in "
        f"a group of {world_size} ranks, but no data-parallel wrapper (DistributedDataParallel, FSDP, ...) "
        "is calling the model: batch statistics are shared across ranks, parameter gradients are not "
        "averaged, so every rank trains its own weights. Wrap the model in DistributedDataParallel (see "
        "docs/recipes.md for accelerate and mmengine), or ignore this if you average gradients yourself.",
        RuntimeWarning,
        stacklevel=3,
    )
