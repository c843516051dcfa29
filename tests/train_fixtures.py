"""A user's own model factories and datasets, for the training job's ``_target_`` tests (imported by name)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset


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


class _KeywordNet(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.net = make_net(num_classes, width)

    def forward(self, x):
        return self.net(x)


def make_net_from_kwargs(**kwargs) -> nn.Module:
    """Passes its keywords on to a constructor, as torchvision's model builders do: a misspelled one
    passes the signature check and fails only when called."""
    return _KeywordNet(**kwargs)


def broken_net(num_classes: int = 10) -> nn.Module:
    """A factory that fails the same way wherever it runs."""
    raise ValueError("no such weights: imagenet-22k")


def net_broken_in_workers(num_classes: int = 10) -> nn.Module:
    """A factory that fails in every worker of a launch (but not before: the check cannot see it), and
    counts its calls in ``$DISTSYNC_TEST_CALLS_DIR``."""
    return _counted("every worker")


def net_broken_on_rank_1(num_classes: int = 10) -> nn.Module:
    """A factory that fails in the worker of rank 1 only."""
    if os.environ.get("RANK") == "1":
        _counted("rank 1")
    return make_net(num_classes)


def _counted(where: str) -> nn.Module:
    calls = os.environ.get("DISTSYNC_TEST_CALLS_DIR")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if calls:
            Path(calls, f"{os.getpid()}").touch()
        raise ValueError(f"broken in {where}")
    return make_net()


def tensor_dataset(size: int, channels: int = 1, image_size: int = 8):
    """A map-style dataset of ``size`` random images and labels."""
    generator = torch.Generator().manual_seed(size)
    images = torch.randn(size, channels, image_size, image_size, generator=generator)
    return TensorDataset(images, torch.randint(10, (size,), generator=generator))
