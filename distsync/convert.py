"""Swap ``nn.BatchNorm*`` / ``nn.SyncBatchNorm`` for :class:`DistSyncBatchNorm` in a module tree, and back."""

from __future__ import annotations

import copy
import sys
import warnings

import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from distsync._syncbn.identity import stamp_paths
from distsync._syncbn.subclass import class_listing_bases, original_class, twin_class
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
    return _mapped(module, lambda cls: _TO_SYNC.get(cls) or twin_class(cls))


def _mapped(module: nn.Module, mapping) -> type:
    """``mapping(type(module))``; for a layer with ``torch.nn.utils.parametrize``d tensors, whose class is
    parametrize's class over the layer's own, that class's properties over ``mapping`` of the layer's own."""
    cls = type(module)
    if not parametrize.is_parametrized(module):
        return mapping(cls)
    own = cls.__bases__[0]  # register_parametrization made Parametrized<own>(own), a property per tensor
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__", "__qualname__")}
    new = mapping(own)
    return class_listing_bases(f"Parametrized{new.__name__}", (new,), namespace, also=cls.__bases__)


def _left_alone(module: nn.Module) -> str | None:
    """Why the batch-norm layer ``module`` is not converted (None if it is)."""
    quantized = sys.modules.get("torch.ao.nn.quantized")  # no quantized layer exists before it is imported
    if quantized is not None and isinstance(module, (quantized.BatchNorm2d, quantized.BatchNorm3d)):
        return "a quantized batch norm normalizes with its stored statistics only (an inference layer)"
    return None


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
    every other attribute, hooks, ``requires_grad``, ``training`` and ``torch.nn.utils.parametrize``
    parametrizations. Quantized batch norms (``torch.ao.nn.quantized``, inference layers) are left as they
    are, with a warning naming them; so is a model without any batch norm.

    Args:
        module: a module tree, or a single batch-norm layer
        process_group: ranks to synchronize with: a process group, a one-dimensional ``DeviceMesh`` or
            ``(mesh, dim)``. Default: ``None``: an ``nn.SyncBatchNorm``'s own group, else the default group

    Returns:
        ``module`` with its batch-norm layers replaced (a new object if ``module`` itself is one).

    Example::

        >>> model = distsync.convert_sync_batchnorm(torchvision.models.resnet18())
    """
    left_alone: dict[str, str] = {}  # reason: the layers
    converted = _convert(module, process_group, "", left_alone)
    for reason, layers in left_alone.items():
        warnings.warn(f"convert_sync_batchnorm left {layers} as they are: {reason}.", UserWarning, 2)
    if not left_alone and not any(isinstance(layer, _BatchNorm) for layer in converted.modules()):
        message = f"convert_sync_batchnorm: {type(module).__name__} holds no batch norm: nothing converted."
        warnings.warn(message, UserWarning, 2)
    stamp_paths(converted)  # every synchronized layer is identified across ranks by its path from here
    return converted


def _convert(
    module: nn.Module, process_group: dist.ProcessGroup | None, path: str, left_alone: dict[str, str]
) -> nn.Module:
    reason = _left_alone(module)
    if reason is not None:
        layer = f"{path or 'the module'} ({type(module).__module__}.{type(module).__qualname__})"
        left_alone[reason] = f"{left_alone[reason]}, {layer}" if reason in left_alone else layer
        return module
    new_cls = _sync_class(module)
    if new_cls is not None:
        if process_group is None:  # an nn.SyncBatchNorm keeps the group it syncs over
            process_group = getattr(module, "process_group", None)
        new = _recast(module, new_cls)
        new._init_sync(process_group)
        return new
    for name, child in module.named_children():
        converted = _convert(child, process_group, f"{path}.{name}".lstrip("."), left_alone)
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
    return _mapped(
        module, lambda cls: original_class(cls) or next(_TO_LOCAL[c] for c in cls.__mro__ if c in _TO_LOCAL)
    )
