"""PyTorch Lightning plugin: ``Trainer(sync_batchnorm=True)`` with distsync instead of ``nn.SyncBatchNorm``.

``nn.SyncBatchNorm`` refuses CPU tensors, so Lightning's own ``sync_batchnorm=True`` fails on CPU/gloo. This
plugin takes its place (it is a ``TorchSyncBatchNorm``, so Lightning accepts it together with the flag)::

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, sync_batchnorm=True,
                      plugins=[DistSyncBatchNormPlugin()])

Needs the ``lightning`` extra: ``pip install "distsync[lightning]"``.
"""

from __future__ import annotations

import torch.distributed as dist
from pytorch_lightning.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn

from .convert import convert_sync_batchnorm, revert_sync_batchnorm

__all__ = ["DistSyncBatchNormPlugin"]


class DistSyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning ``LayerSync`` that swaps batch norm layers for distsync's while fitting, and back after.

    Args:
        process_group: ranks to synchronize with (e.g. from :func:`distsync.create_syncbn_process_group`).
            Default: ``None`` (the default group)
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_sync_batchnorm(model, process_group=self.process_group)

    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)
