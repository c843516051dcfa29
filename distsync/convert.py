"""Swap ``nn.BatchNorm*`` / ``nn.SyncBatchNorm`` for :class:`DistSyncBatchNorm` in a module tree, and back."""

from __future__ import annotations

import copy

import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from distsync._syncbn.identity import stamp_paths
from distsync._syncbn.subclass import original_class, twin_class
from distsync.batchnorm import (
    BatchNormNd,
    DistSyncBatchNorm,
    DistSyncBatchNorm1d,
    DistSyncBatchNorm2d,
    DistSyncBatchNorm3d,
    DistSyncSyncBatchNorm,
)
from distsync.groups import GroupSpec

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm", "BatchNormNd"]


# Each converted layer is an instance of the class it replaced (isinstance checks, freeze-BN loops, fusers).
_TO_SYNC = {
    nn.BatchNorm1d: DistSyncBatchNorm1d,
    nn.BatchNorm2d: DistSyncBatchNorm2d,
    nn.BatchNorm3d: DistSyncBatchNorm3d,
    nn.SyncBatchNorm: DistSyncSyncBatchNorm,
    BatchNormNd: DistSyncBatchNorm,
}
_TO_LOCAL = {
    DistSyncBatchNorm1d: nn.BatchNorm1d,
    DistSyncBatchNorm2d: nn.BatchNorm2d,
    DistSyncBatchNorm3d: nn.BatchNorm3d,
    DistSyncBatchNorm: BatchNormNd,
}


def _recast(module: nn.Module, cls: type[nn.Module], drop: tuple[str, ...] = ()) -> nn.Module:
    """A ``cls`` object with ``module``'s state: the same parameters, buffers, children and attributes
    (the same objects, in containers of its own), less the attributes named in ``drop``."""
    new = cls.__new__(cls)
    for name, value in module.__dict__.items():
        if name not in drop:
            new.__dict__[name] = copy.copy(value) if isinstance(value, (dict, set, list)) else value
    return new


def _sync_class(module: nn.Module) -> type[DistSyncBatchNorm] | None:
    """The distsync class for ``module`` (None if it is no batch-norm layer, or already synchronized)."""
    if isinstance(module, DistSyncBatchNorm) or not isinstance(module, _BatchNorm):
        return None
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(
            f"cannot convert the uninitialized {type(module).__name__}: its number of features is not known "
            "yet. Run one forward pass (or initialize the lazy model) before convert_sync_batchnorm."
        )
    return _TO_SYNC.get(type(module)) or twin_class(type(module))


def convert_sync_batchnorm(module: nn.Module, process_group: GroupSpec = None) -> nn.Module:
    """Replace every batch-norm layer in ``module`` by its distsync twin, as PyTorch's converter does.

    ``nn.BatchNorm1d/2d/3d`` become ``DistSyncBatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` the rank-agnostic
    ``DistSyncBatchNorm``. A subclass of any of them (timm's ``BatchNormAct2d``, your own) becomes its
    synchronized twin: an instance of both the subclass and ``DistSyncBatchNorm`` that runs the subclass's
    own forward (activation, dropout, checks, extra parameters and buffers, all kept) with the batch-norm
    computation in it synchronized. A subclass whose forward computes its statistics without
    ``F.batch_norm`` or the base class's forward cannot be synchronized: its first training call raises
    ``ValueError``, on every rank. An uninitialized lazy layer is refused. Parameters, buffers and
    children are kept as the same objects (so optimizers built before still point at them), and so are
    every other attribute, hooks, ``requires_grad`` and ``training``.

    Args:
        module: a module tree, or a single batch-norm layer
        process_group: ranks to synchronize with: a process group, a one-dimensional ``DeviceMesh`` or
            ``(mesh, dim)``. Default: ``None``: an ``nn.SyncBatchNorm``'s own group, else the default group

    Returns:
        ``module`` with its batch-norm layers replaced (a new object if ``module`` itself is one).

    Example::

        >>> model = distsync.convert_sync_batchnorm(torchvision.models.resnet18())
    """
    converted = _convert(module, process_group)
    stamp_paths(converted)  # every synchronized layer is identified across ranks by its path from here
    return converted


def _convert(module: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
    new_cls = _sync_class(module)
    if new_cls is not None:
        if process_group is None:  # an nn.SyncBatchNorm keeps the group it syncs over
            process_group = getattr(module, "process_group", None)
        new = _recast(module, new_cls)
        new._init_sync(process_group)
        return new
    for name, child in module.named_children():
        converted = _convert(child, process_group)
        if converted is not child:
            module.add_module(name, converted)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every :class:`DistSyncBatchNorm` in ``module`` by plain ``nn.BatchNorm1d/2d/3d``.

    For export and single-process inference. The rank-agnostic ``DistSyncBatchNorm`` becomes
    :class:`BatchNormNd`, and a converted subclass its original class again. Parameters, buffers and
    children are kept as the same objects.
    """
    new_cls = _local_class(module)
    if new_cls is not None:
        drop = DistSyncBatchNorm._SYNC_ATTRIBUTES
        if issubclass(new_cls, nn.SyncBatchNorm):  # its own attribute, the group it syncs over
            drop = tuple(name for name in drop if name != "process_group")
        return _recast(module, new_cls, drop)
    for name, child in module.named_children():
        converted = revert_sync_batchnorm(child)
        if converted is not child:
            module.add_module(name, converted)
    return module


def _local_class(module: nn.Module) -> type[_BatchNorm] | None:
    """The class a synchronized layer is reverted to (None for any other module)."""
    if not isinstance(module, DistSyncBatchNorm):
        return None
    return original_class(type(module)) or next(_TO_LOCAL[c] for c in type(module).__mro__ if c in _TO_LOCAL)
