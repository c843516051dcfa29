"""A user's own model factory, for the training job's ``model.factory`` tests (imported by name)."""

from __future__ import annotations

from torch import nn


def make_net(num_classes: int = 10, width: int = 8) -> nn.Module:
    """A tiny conv net with one batch norm, as a user's module would provide."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )
