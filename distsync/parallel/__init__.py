"""Compatibility shim: ``nn.DataParallel`` code of jactorch, Synchronized-BatchNorm and PyTorch-Encoding.

Change the imports, keep the code, get batch norm synchronized across devices. It exists to migrate;
torchrun + ``DistributedDataParallel`` is the way forward (``docs/migration.md``).
"""

from torch import nn

from distsync.batchnorm import DistSyncBatchNorm1d, DistSyncBatchNorm2d, DistSyncBatchNorm3d
from distsync.convert import convert_sync_batchnorm
from distsync.parallel.comm import FutureResult, SlavePipe, SyncMaster
from distsync.parallel.data_parallel import DataParallelCriterion, DataParallelModel
from distsync.parallel.replica_sync import ReplicaReducer
from distsync.parallel.replicate import (
    CallbackContext,
    DataParallelWithCallback,
    ReplicationCallbackDataParallel,
    exec_data_parallel_replication_callback,
    execute_replication_callbacks,
    patch_replication_callback,
)
from distsync.parallel.sync_batchnorm import (
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    patch_sync_batchnorm,
    set_sbn_eps_mode,
)

__all__ = [
    "CallbackContext",
    "DataParallelCriterion",
    "DataParallelModel",
    "DataParallelWithCallback",
    "FutureResult",
    "ReplicaReducer",
    "ReplicationCallbackDataParallel",
    "SlavePipe",
    "SyncMaster",
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "convert_model",
    "exec_data_parallel_replication_callback",
    "execute_replication_callbacks",
    "patch_replication_callback",
    "patch_sync_batchnorm",
    "set_sbn_eps_mode",
]


def convert_model(module: nn.Module) -> nn.Module:
    """Synchronized-BatchNorm's converter: batch norm layers of ``module`` become ``SynchronizedBatchNorm*d``.

    ``nn.BatchNorm1d/2d/3d`` (and ``nn.SyncBatchNorm``) are replaced as by
    :func:`distsync.convert_sync_batchnorm`, parameters and buffers kept, and follow
    :func:`set_sbn_eps_mode` like the source library's layers. Given an ``nn.DataParallel``, it returns a
    :class:`DataParallelWithCallback` over the converted module with the same devices.

    Examples::

        >>> model = convert_model(nn.DataParallel(torchvision.models.resnet18(), device_ids=[0, 1]))
    """
    if isinstance(module, nn.DataParallel):
        return DataParallelWithCallback(
            convert_model(module.module),
            device_ids=module.device_ids or None,
            output_device=getattr(module, "output_device", None),
            dim=getattr(module, "dim", 0),
        )
    converted = convert_sync_batchnorm(module)
    for layer in converted.modules():
        alias = _ALIASES.get(type(layer))
        if alias is not None:  # the alias only adds the eps-mode switch: same state, same layout
            layer.__class__ = alias
    return converted


_ALIASES = {
    DistSyncBatchNorm1d: SynchronizedBatchNorm1d,
    DistSyncBatchNorm2d: SynchronizedBatchNorm2d,
    DistSyncBatchNorm3d: SynchronizedBatchNorm3d,
}
