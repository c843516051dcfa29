"""A synthetic classification datamodule: separable clusters, the same data on every rank (seeded)."""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Synthetic(pl.LightningDataModule):
    def __init__(self, features: int = 8, classes: int = 3, samples: int = 256, batch_size: int = 16) -> None:
        super().__init__()
        self.features, self.classes, self.samples, self.batch_size = features, classes, samples, batch_size

    def setup(self, stage=None):
        gen = torch.Generator().manual_seed(0)
        centers = torch.randn(self.classes, self.features, generator=gen) * 3
        labels = torch.randint(self.classes, (self.samples,), generator=gen)
        points = centers[labels] + torch.randn(self.samples, self.features, generator=gen)
        split = self.samples * 3 // 4
        self.train = TensorDataset(points[:split], labels[:split])
        self.val = TensorDataset(points[split:], labels[split:])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)
