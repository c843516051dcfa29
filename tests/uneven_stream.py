"""A streaming dataset that shards itself per rank at iteration time, with uneven shards (the data target of
tests/test_train_streaming.py): rank r yields ``batches[r]`` batches' worth of samples per pass."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

SIZE, CLASSES = 6, 3


def samples(rank: int, epoch: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s samples of pass ``epoch`` (float64; the stream yields them as float32)."""
    gen = torch.Generator().manual_seed(1000 * epoch + rank)
    images = torch.randn(count, 1, SIZE, SIZE, generator=gen, dtype=torch.float64) * (1 + rank) + rank
    return images, torch.randint(CLASSES, (count,), generator=gen)


class UnevenStream(IterableDataset):
    """Rank r's share: ``batches[r] * batch_size`` samples per pass, reshuffled by ``set_epoch``."""

    def __init__(self, batches: list[int], batch_size: int) -> None:
        self.batches, self.batch_size, self.epoch = list(batches), batch_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        images, labels = samples(rank, self.epoch, self.batches[rank] * self.batch_size)
        yield from zip(images.float(), labels, strict=True)


def held_out(count: int = 24) -> TensorDataset:
    images, labels = samples(99, 0, count)
    return TensorDataset(images.float(), labels)


def make_net() -> nn.Module:
    """BN first: its running statistics depend on the data only, whatever the optimizer does."""
    return nn.Sequential(
        nn.BatchNorm2d(1), nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(4, CLASSES),
    )  # fmt: skip


class _Checkpointed(nn.Sequential):
    """make_net's layers, the middle ones checkpointed (as timm's set_grad_checkpointing does)."""

    def forward(self, x):
        x = self[0](x)
        x = torch.utils.checkpoint.checkpoint_sequential(list(self)[1:4], 2, x, use_reentrant=False)
        for layer in list(self)[4:]:
            x = layer(x)
        return x


def make_checkpointed_net() -> nn.Module:
    return _Checkpointed(*make_net())
