"""distsync: synchronized batch norm and data-parallel tools natively on ``torch.distributed``.

``import distsync`` loads the synchronized layer and nothing else. The launcher (:func:`launch`,
:class:`DeviceSet`), the ``nn.DataParallel`` compatibility shim (``ReplicationCallbackDataParallel``, ...)
and the Optuna helpers (:func:`report`, :func:`should_prune`) are top-level names too, imported on their
first use (PEP 562), so a training script that only syncs batch norm never loads them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from distsync.precise_bn import update_bn

if TYPE_CHECKING:  # the names below, for type checkers and editors
    from distsync.launching.device_split import DeviceSet
    from distsync.launching.elastic import LaunchError, NonRetryableError, launch
    from distsync.parallel import *  # noqa: F403
    from distsync.tuning import report, should_prune

_SHIM_NAMES = (
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
)
"""The DataParallel shim's names (``distsync.parallel.__all__``, a test holds them equal): top-level too, so
old imports need only a package rename."""

_LAZY: dict[str, str] = {
    "DeviceSet": "distsync.launching.device_split",
    "LaunchError": "distsync.launching.elastic",
    "NonRetryableError": "distsync.launching.elastic",
    "launch": "distsync.launching.elastic",
    "report": "distsync.tuning",
    "should_prune": "distsync.tuning",
    **dict.fromkeys(_SHIM_NAMES, "distsync.parallel"),
}
"""Top-level names imported on first use, and the module each comes from."""

_SUBPACKAGES = ("launching", "parallel", "tuning")
"""Modules that ``distsync.<name>`` reaches without an import of their own, as it did when ``import
distsync`` loaded them (``distsync.tuning.report_result(...)``)."""


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"distsync.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBPACKAGES})


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
    *_SHIM_NAMES,
]
