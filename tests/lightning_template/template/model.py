"""A LightningModule holding torchmetrics metrics and batch norm (what distsync converts)."""

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn


class Classifier(pl.LightningModule):
    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 3, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=classes)
        self.train_loss = torchmetrics.MeanMetric()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_loss(loss)
        self.train_acc(logits, y)
        self.log("train/loss", self.train_loss, on_step=True, sync_dist=True)
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val/acc", self.val_acc, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
