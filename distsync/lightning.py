"""PyTorch Lightning plugin: ``Trainer(sync_batchnorm=True)`` with distsync instead of ``nn.SyncBatchNorm``.

``nn.SyncBatchNorm`` refuses CPU tensors, so Lightning's own ``sync_batchnorm=True`` fails on CPU/gloo. This
plugin takes its place (it is a ``TorchSyncBatchNorm``, so Lightning accepts it together with the flag)::

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, sync_batchnorm=True,
                      plugins=[DistSyncBatchNormPlugin()])  # or DistSyncBatchNormPlugin(group_size=8)

Needs the ``lightning`` extra: ``pip install "distsync[lightning]"``.
"""

from __future__ import annotations

import torch.distributed as dist
from pytorch_lightning.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn

from .convert import convert_sync_batchnorm, revert_sync_batchnorm
from .groups import create_syncbn_process_group

__all__ = ["DistSyncBatchNormPlugin"]


class DistSyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning ``LayerSync`` that swaps batch norm layers for distsync's while fitting, and back after.

    Lightning starts the processes and joins the process group after the ``Trainer`` is built, so a group
    is best given by its size: the plugin creates it with :func:`distsync.create_syncbn_process_group`
    when Lightning applies it, on every rank.

    Args:
        group_size: synchronize within groups of this many consecutive ranks (apex's recipe at scale).
            Default: ``0`` (the whole world)
        process_group: an existing group to synchronize over instead (exclusive with ``group_size``).
            Default: ``None`` (the default group)
    """

    def __init__(self, group_size: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
        if group_size and process_group is not None:
            raise ValueError("DistSyncBatchNormPlugin: give group_size or process_group, not both")
        self.group_size = group_size
        self.process_group = process_group

    def apply(self, model: nn.Module) -> nn.Module:
        group = self.process_group
        if self.group_size and dist.is_initialized():
            group = create_syncbn_process_group(self.group_size)
        return convert_sync_batchnorm(model, process_group=group)

    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)
