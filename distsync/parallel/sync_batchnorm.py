"""Synchronized-BatchNorm's batch-norm names: the layers, ``set_sbn_eps_mode`` and ``patch_sync_batchnorm``.

vacancy's Synchronized-BatchNorm computes the synchronized standard deviation as
``sqrt(max(var, eps))`` (``"clamp"``) by default, where ``nn.BatchNorm`` uses ``sqrt(var + eps)``
(``"plus"``), and reads the mode from a process-wide switch at every call. Its layers here do the same,
so a migrated model trains as before; ``distsync.DistSyncBatchNorm*d`` are untouched by the switch. As in
the source library, the mode applies to synchronized training; eval mode and unsynchronized calls use
``var + eps``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from distsync.batchnorm import (
    DistSyncBatchNorm,
    DistSyncBatchNorm1d,
    DistSyncBatchNorm2d,
    DistSyncBatchNorm3d,
)

__all__ = [
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "patch_sync_batchnorm",
    "set_sbn_eps_mode",
]

_EPS_MODES = ("clamp", "plus")
_eps_mode = "clamp"


def set_sbn_eps_mode(mode: str) -> None:
    """Choose how eps enters the synchronized statistics of the ``SynchronizedBatchNorm*d`` layers.

    Args:
        mode: ``"clamp"`` for ``sqrt(max(var, eps))`` (the default, as in Synchronized-BatchNorm) or
            ``"plus"`` for ``sqrt(var + eps)``, as ``nn.BatchNorm``. Read at every call, by every such layer.
    """
    global _eps_mode
    if mode not in _EPS_MODES:
        raise ValueError(f"unknown eps mode {mode!r}: expected one of {_EPS_MODES}")
    _eps_mode = mode


class _FollowsEpsSwitch(DistSyncBatchNorm):
    @property
    def eps_mode(self) -> str:
        return _eps_mode


class SynchronizedBatchNorm1d(_FollowsEpsSwitch, DistSyncBatchNorm1d):
    """Synchronized-BatchNorm's ``SynchronizedBatchNorm1d``: :class:`distsync.DistSyncBatchNorm1d` with its
    eps mode (see :func:`set_sbn_eps_mode`)."""


class SynchronizedBatchNorm2d(_FollowsEpsSwitch, DistSyncBatchNorm2d):
    """Synchronized-BatchNorm's ``SynchronizedBatchNorm2d``: :class:`distsync.DistSyncBatchNorm2d` with its
    eps mode (see :func:`set_sbn_eps_mode`)."""


class SynchronizedBatchNorm3d(_FollowsEpsSwitch, DistSyncBatchNorm3d):
    """Synchronized-BatchNorm's ``SynchronizedBatchNorm3d``: :class:`distsync.DistSyncBatchNorm3d` with its
    eps mode (see :func:`set_sbn_eps_mode`)."""


@contextlib.contextmanager
def patch_sync_batchnorm() -> Iterator[None]:
    """Within the block, ``nn.BatchNorm1d/2d/3d`` are the ``SynchronizedBatchNorm*d`` layers.

    For models whose code builds ``nn.BatchNorm*d`` itself. The originals are restored on exit, also on error.
    ``distsync.convert_sync_batchnorm`` on a built model is the alternative that patches nothing.
    """
    saved = nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d = (
        SynchronizedBatchNorm1d,
        SynchronizedBatchNorm2d,
        SynchronizedBatchNorm3d,
    )
    try:
        yield
    finally:
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d = saved
