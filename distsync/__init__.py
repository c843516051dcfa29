"""distsync: synchronized batch norm and data-parallel tools natively on ``torch.distributed``."""

from .batchnorm import DistSyncBatchNorm, DistSyncBatchNorm1d, DistSyncBatchNorm2d, DistSyncBatchNorm3d
from .convert import BatchNormNd, convert_sync_batchnorm, revert_sync_batchnorm
from .distributed import init_distributed
from .errors import SyncError, SyncMismatchError
from .parallel import (
    CallbackContext,
    DataParallelCriterion,
    DataParallelModel,
    DataParallelWithCallback,
    ReplicationCallbackDataParallel,
    SlavePipe,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    SyncMaster,
    convert_model,
    exec_data_parallel_replication_callback,
    patch_replication_callback,
)

__all__ = [
    # the DataParallel compatibility shim (distsync.parallel)
    "CallbackContext",
    "DataParallelCriterion",
    "DataParallelModel",
    "DataParallelWithCallback",
    "ReplicationCallbackDataParallel",
    "SlavePipe",
    "SyncMaster",
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "convert_model",
    "exec_data_parallel_replication_callback",
    "patch_replication_callback",
    # core
    "BatchNormNd",
    "DistSyncBatchNorm",
    "DistSyncBatchNorm1d",
    "DistSyncBatchNorm2d",
    "DistSyncBatchNorm3d",
    "SyncError",
    "SyncMismatchError",
    "convert_sync_batchnorm",
    "init_distributed",
    "revert_sync_batchnorm",
]
