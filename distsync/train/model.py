"""The small CNN trained by :mod:`distsync.train`, with its batch norms chosen by ``model.norm``."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import distsync
from distsync.train.config import ModelConfig
from distsync.train.targets import instantiate

__all__ = ["SmallCNN", "build_model", "all_norms_synced", "batch_norms"]


class SmallCNN(nn.Module):
    """Conv-BN-ReLU blocks (a 2x2 max pool before every block but the first), global pooling, a classifier.

    Args:
        in_channels: channels of the input images
        num_classes: number of output logits
        channels: output channels of each block. Default: ``(32, 64, 64)``
        dropout: dropout before the classifier. Default: 0
    """

    def __init__(
        self, in_channels: int, num_classes: int, channels=(32, 64, 64), dropout: float = 0.0
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_channels
        for i, out in enumerate(channels):
            if i > 0:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
            layers += [
                nn.Conv2d(width, out, 3, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
            ]
            width = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(width, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def build_model(cfg: ModelConfig, in_channels: int, num_classes: int) -> nn.Module:
    """The model of ``model.factory`` (else a :class:`SmallCNN`) whose batch norms are DistSyncBatchNorm
    (``sync``), per-rank ``nn.BatchNorm*`` (``local``) or ``nn.SyncBatchNorm`` (``torch``)."""
    if cfg.factory:
        model = instantiate(cfg.factory)
        if not isinstance(model, nn.Module):
            raise TypeError(f"it returned {type(model).__name__}, not an nn.Module")
    else:
        model = SmallCNN(in_channels, num_classes, tuple(cfg.channels), cfg.dropout)
    if cfg.norm == "sync":
        return distsync.convert_sync_batchnorm(model)
    if cfg.norm == "torch":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def batch_norms(model: nn.Module) -> list[_BatchNorm]:
    """Every batch-norm layer of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def all_norms_synced(model: nn.Module) -> bool:
    """True when every batch norm synchronizes its statistics, so DDP need not broadcast buffers."""
    return all(isinstance(m, (distsync.DistSyncBatchNorm, nn.SyncBatchNorm)) for m in batch_norms(model))
