"""Swap ``nn.BatchNorm*`` / ``nn.SyncBatchNorm`` for :class:`DistSyncBatchNorm` in a module tree, and back."""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ._identity import record_tree
from .batchnorm import DistSyncBatchNorm, DistSyncBatchNorm1d, DistSyncBatchNorm2d, DistSyncBatchNorm3d

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm", "BatchNormNd"]


class BatchNormNd(_BatchNorm):
    """Plain batch norm accepting any input rank >= 2: the local twin of a rank-agnostic sync layer."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


_TO_SYNC = {
    nn.BatchNorm1d: DistSyncBatchNorm1d,
    nn.BatchNorm2d: DistSyncBatchNorm2d,
    nn.BatchNorm3d: DistSyncBatchNorm3d,
    nn.SyncBatchNorm: DistSyncBatchNorm,
    BatchNormNd: DistSyncBatchNorm,
}
_TO_LOCAL = {
    DistSyncBatchNorm1d: nn.BatchNorm1d,
    DistSyncBatchNorm2d: nn.BatchNorm2d,
    DistSyncBatchNorm3d: nn.BatchNorm3d,
    DistSyncBatchNorm: BatchNormNd,
}


def _swap(module: _BatchNorm, new_cls: type[_BatchNorm], **extra) -> _BatchNorm:
    """A ``new_cls`` layer sharing ``module``'s parameters and buffers (the same tensor objects)."""
    reference = module.running_mean if module.weight is None else module.weight
    factory = {} if reference is None else {"device": reference.device, "dtype": reference.dtype}
    new = new_cls(
        module.num_features,
        module.eps,
        module.momentum,
        module.affine,
        module.track_running_stats,
        bias=not module.affine or module.bias is not None,
        **extra,
        **factory,
    )
    for name, param in module.named_parameters(recurse=False):
        setattr(new, name, param)
    for name, buffer in module.named_buffers(recurse=False):
        setattr(new, name, buffer)
    new.train(module.training)
    if hasattr(module, "qconfig"):
        new.qconfig = module.qconfig
    return new


def _match(module: nn.Module, table: dict) -> type | None:
    return next((table[cls] for cls in type(module).__mro__ if cls in table), None)


def _sync_class(module: nn.Module) -> type[DistSyncBatchNorm] | None:
    """The distsync class for ``module``, as PyTorch's converter would pick it (any ``_BatchNorm``)."""
    if isinstance(module, DistSyncBatchNorm) or not isinstance(module, _BatchNorm):
        return None
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(
            f"cannot convert the uninitialized {type(module).__name__}: its number of features is not known "
            "yet. Run one forward pass (or initialize the lazy model) before convert_sync_batchnorm."
        )
    new_cls = _match(module, _TO_SYNC) or DistSyncBatchNorm
    if type(module) not in _TO_SYNC:
        warnings.warn(
            f"convert_sync_batchnorm: {type(module).__name__} is converted to {new_cls.__name__} like "
            "nn.SyncBatchNorm.convert_sync_batchnorm would; its own forward and input checks are not kept",
            UserWarning,
            stacklevel=3,
        )
    return new_cls


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every batch-norm layer in ``module`` by its distsync twin, as PyTorch's converter does.

    ``nn.BatchNorm1d/2d/3d`` (and their subclasses) become ``DistSyncBatchNorm1d/2d/3d``; ``nn.SyncBatchNorm``
    and any other ``_BatchNorm`` become the rank-agnostic ``DistSyncBatchNorm`` (with a warning for custom
    subclasses, whose own forward is not kept). An uninitialized lazy layer is refused. Parameters are kept
    as the same objects (so optimizers built before still point at them), and so are buffers,
    ``requires_grad``, ``training``, ``bias=False``, device and dtype.

    Args:
        module: a module tree, or a single batch-norm layer
        process_group: ranks to synchronize with. Default: ``None``: an ``nn.SyncBatchNorm``'s own group,
            else the default group

    Returns:
        ``module`` with its batch-norm layers replaced (a new object if ``module`` itself is one).

    Example::

        >>> model = distsync.convert_sync_batchnorm(torchvision.models.resnet18())
    """
    converted = _convert(module, process_group)
    record_tree(converted)  # a loaded tree has no registration records: the new layers' paths need them
    return converted


def _convert(module: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
    new_cls = _sync_class(module)
    if new_cls is not None:
        if process_group is None:  # an nn.SyncBatchNorm keeps the group it syncs over
            process_group = getattr(module, "process_group", None)
        return _swap(module, new_cls, process_group=process_group)
    for name, child in module.named_children():
        converted = _convert(child, process_group)
        if converted is not child:
            module.add_module(name, converted)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every :class:`DistSyncBatchNorm` in ``module`` by plain ``nn.BatchNorm1d/2d/3d``.

    For export and single-process inference. The rank-agnostic ``DistSyncBatchNorm`` becomes
    :class:`BatchNormNd`. Parameters and buffers are kept as the same objects.
    """
    new_cls = _match(module, _TO_LOCAL)
    if new_cls is not None:
        return _swap(module, new_cls)
    for name, child in module.named_children():
        converted = revert_sync_batchnorm(child)
        if converted is not child:
            module.add_module(name, converted)
    return module
