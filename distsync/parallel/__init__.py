"""Compatibility shim: ``nn.DataParallel`` code of jactorch, Synchronized-BatchNorm and PyTorch-Encoding.

Change the imports, keep the code, get batch norm synchronized across devices. It exists to migrate;
torchrun + ``DistributedDataParallel`` is the way forward (``docs/migration.md``).
"""

from torch import nn

from ..batchnorm import DistSyncBatchNorm1d, DistSyncBatchNorm2d, DistSyncBatchNorm3d
from ..convert import convert_sync_batchnorm
from .comm import FutureResult, SlavePipe, SyncMaster
from .data_parallel import DataParallelCriterion, DataParallelModel
from .replicate import (
    CallbackContext,
    DataParallelWithCallback,
    ReplicationCallbackDataParallel,
    exec_data_parallel_replication_callback,
    execute_replication_callbacks,
    patch_replication_callback,
)
from .transport import ReplicaReducer

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
]

SynchronizedBatchNorm1d = DistSyncBatchNorm1d
SynchronizedBatchNorm2d = DistSyncBatchNorm2d
SynchronizedBatchNorm3d = DistSyncBatchNorm3d


def convert_model(module: nn.Module) -> nn.Module:
    """Synchronized-BatchNorm's converter: batch norm layers of ``module`` become synchronized ones.

    ``nn.BatchNorm1d/2d/3d`` (and ``nn.SyncBatchNorm``) are replaced as by
    :func:`distsync.convert_sync_batchnorm`, parameters and buffers kept. Given an ``nn.DataParallel``,
    it returns a :class:`DataParallelWithCallback` over the converted module with the same devices.

    Examples::

        >>> model = convert_model(nn.DataParallel(torchvision.models.resnet18(), device_ids=[0, 1]))
    """
    if isinstance(module, nn.DataParallel):
        return DataParallelWithCallback(
            convert_sync_batchnorm(module.module),
            device_ids=module.device_ids or None,
            output_device=getattr(module, "output_device", None),
            dim=getattr(module, "dim", 0),
        )
    return convert_sync_batchnorm(module)
