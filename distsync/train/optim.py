"""The optimizer and learning-rate schedule that ``optim.*`` asks for."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from distsync.train.config import TrainConfig
from distsync.train.targets import instantiate

__all__ = ["build_optimizer", "build_scheduler"]


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``optim.factory`` (given ``optim.lr`` unless it sets ``lr``), else AdamW or SGD (Nesterov momentum)."""
    o = cfg.optim
    if o.factory:
        return instantiate(o.factory, model.parameters(), **({} if "lr" in o.factory else {"lr": o.lr}))
    if o.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.momentum > 0
    )


def build_scheduler(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """``optim.scheduler``, else linear warm-up then constant or cosine decay over ``trainer.max_steps``."""
    if cfg.optim.scheduler:
        return instantiate(cfg.optim.scheduler, optimizer)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_then(cfg))


def _warmup_then(cfg: TrainConfig) -> Callable[[int], float]:
    warmup, total, cosine = cfg.optim.warmup_steps, cfg.trainer.max_steps, cfg.optim.schedule == "cosine"

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
