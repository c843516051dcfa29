"""distsync: synchronized batch norm and data-parallel tools natively on ``torch.distributed``."""

from ._health import check_sync
from ._identity import name_layers
from .batchnorm import DistSyncBatchNorm, DistSyncBatchNorm1d, DistSyncBatchNorm2d, DistSyncBatchNorm3d
from .convert import BatchNormNd, convert_sync_batchnorm, revert_sync_batchnorm
from .devices import DeviceSet
from .distributed import init_distributed, no_buffer_broadcast
from .elastic import LaunchError, NonRetryableError, launch
from .errors import SyncError, SyncMismatchError
from .groups import create_syncbn_process_group
from .join import joinable

# The DataParallel compatibility shim's names are top-level too, so old imports need only a package rename.
from .parallel import *  # noqa: E402, F403
from .parallel import __all__ as _shim_names  # noqa: E402
from .precise_bn import update_bn
from .tuning import report, should_prune

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
