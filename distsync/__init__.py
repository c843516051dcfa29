"""distsync: synchronized batch norm and data-parallel tools natively on ``torch.distributed``."""

from distsync._syncbn.health import check_sync
from distsync._syncbn.identity import name_layers
from distsync.batchnorm import (
    DistSyncBatchNorm,
    DistSyncBatchNorm1d,
    DistSyncBatchNorm2d,
    DistSyncBatchNorm3d,
)
from distsync.convert import BatchNormNd, convert_sync_batchnorm, revert_sync_batchnorm
from distsync.distributed import init_distributed, no_buffer_broadcast
from distsync.errors import SyncError, SyncMismatchError
from distsync.groups import create_syncbn_process_group
from distsync.join import joinable
from distsync.launching.devices import DeviceSet
from distsync.launching.elastic import LaunchError, NonRetryableError, launch

# The DataParallel compatibility shim's names are top-level too, so old imports need only a package rename.
from distsync.parallel import *  # noqa: E402, F403
from distsync.parallel import __all__ as _shim_names  # noqa: E402
from distsync.precise_bn import update_bn
from distsync.tuning import report, should_prune

__all__ = [
    "BatchNormNd",
    "DeviceSet",
    "DistSyncBatchNorm",
    "DistSyncBatchNorm1d",
    "DistSyncBatchNorm2d",
    "DistSyncBatchNorm3d",
    "LaunchError",
    "NonRetryableError",
    "SyncError",
    "SyncMismatchError",
    "check_sync",
    "create_syncbn_process_group",
    "convert_sync_batchnorm",
    "init_distributed",
    "joinable",
    "launch",
    "name_layers",
    "no_buffer_broadcast",
    "report",
    "revert_sync_batchnorm",
    "should_prune",
    "update_bn",
    *_shim_names,
]
