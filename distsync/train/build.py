"""The job's pieces from its config: the model, the optimizer and the learning-rate schedule, and the
check that builds them all once before any worker starts.

Building the datasets, the model, the loss, the optimizer and the schedule fails the same way on every
rank and on every attempt when the config is wrong: a factory that raises, a keyword a ``**kwargs``
factory passes on to a constructor that rejects it, a batch larger than a rank's share of the data.
:func:`check_buildable` builds them once in the launching process (the model on the meta device), so that
such an error costs one line before any worker starts; :func:`building` gives the workers' own build the
same messages, for the errors that only show there.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import distsync
from distsync.train.config import ConfigError, ModelConfig, TrainConfig
from distsync.train.data import batches_per_epoch, load_data
from distsync.train.streaming import check_streaming, first_input, is_stream
from distsync.train.targets import instantiate

__all__ = [
    "SmallCNN",
    "build_model",
    "all_norms_synced",
    "batch_norms",
    "build_optimizer",
    "build_scheduler",
    "building",
    "check_buildable",
    "check_builtin_data",
]


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


@contextlib.contextmanager
def building(key: str, node: dict | None = None) -> Iterator[None]:
    """An exception raised while building ``key`` (from ``node``), as a one-line :class:`ConfigError`."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:
        target = f" ({node['_target_']})" if node and "_target_" in node else ""
        lines = [line.strip() for line in str(error).strip().splitlines()]
        if len(lines) > 1 and lines[0].endswith(":"):  # Hydra's "Error loading 'x':" and the cause below
            lines[0] += f" {lines[1]}"
        cause = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        raise ConfigError(f"{key}{target}: {cause}") from error


def check_buildable(cfg: TrainConfig, world_size: int) -> None:
    """Build every piece of the job once, here, and raise :class:`ConfigError` naming what fails.

    The datasets are built as the workers build them; the model on the meta device (no memory, no
    initialization), or on the CPU for a factory that cannot run on meta; the optimizer and the schedule
    over its parameters where a factory gives them (building torch's optimizers imports ``torch._dynamo``,
    which this process would otherwise not need).
    """
    with warnings.catch_warnings():  # the workers warn about whatever deserves it
        warnings.simplefilter("ignore")
        if cfg.data.train:
            in_channels, num_classes = _check_datasets(cfg, world_size)
        else:
            in_channels, num_classes = check_builtin_data(cfg, world_size)
        model = _build_model_off_device(lambda: build_model(cfg.model, in_channels, num_classes), cfg)
        if cfg.model.loss:
            with building("model.loss", cfg.model.loss):
                instantiate(cfg.model.loss)
        if not (cfg.optim.factory or cfg.optim.scheduler):
            return  # the built-in optimizer and schedule take only values the config has checked
        with building("optim.factory" if cfg.optim.factory else "optim", cfg.optim.factory):
            optimizer = build_optimizer(cfg, model)
        with building("optim.scheduler" if cfg.optim.scheduler else "optim", cfg.optim.scheduler):
            build_scheduler(cfg, optimizer)


def check_builtin_data(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """Refuse built-in data that leaves a rank without a batch or nothing held out; its channels and
    classes otherwise."""
    with warnings.catch_warnings():  # an empty split warns in load_data; the error below says more
        warnings.simplefilter("ignore")
        (train_images, train_labels), (_, test_labels), num_classes = load_data(cfg.data)
    per_rank = len(train_labels) // world_size
    split = f"data.test_fraction={cfg.data.test_fraction} leaves {len(train_labels)} training samples"
    if len(test_labels) == 0:  # first: no batch size can fix it
        raise ConfigError(
            f"data.test_fraction={cfg.data.test_fraction} leaves no held-out samples ({len(train_labels)} "
            "samples in all); use more samples or a larger data.test_fraction"
        )
    if per_rank == 0:
        raise ConfigError(f"{split}, fewer than the {world_size} ranks")
    if cfg.data.batch_size > per_rank:
        raise ConfigError(
            f"data.batch_size must be at most {per_rank} ({split}, {per_rank} per rank over {world_size} "
            f"ranks) (got {cfg.data.batch_size})"
        )
    return train_images.shape[1], num_classes


def _check_datasets(cfg: TrainConfig, world_size: int) -> tuple[int | None, int]:
    """Build ``data.train``/``data.test`` and check the batch size against a rank's share."""
    with building("data.train", cfg.data.train):
        train = instantiate(cfg.data.train)
    with building("data.test", cfg.data.test):
        instantiate(cfg.data.test)
    if is_stream(train):
        check_streaming(cfg)
    if hasattr(train, "__len__"):  # a stream's length is its own business
        batches_per_epoch(len(train) // world_size, cfg.data.batch_size, world_size, len(train))
    if cfg.model.factory:
        return None, cfg.data.num_classes
    with building("data.train", cfg.data.train):  # the first sample: the channels of the built-in CNN
        return first_input(train).shape[0], cfg.data.num_classes


def _build_model_off_device(build: Callable[[], nn.Module], cfg: TrainConfig) -> nn.Module:
    key = "model.factory" if cfg.model.factory else "model"
    try:
        with torch.device("meta"):
            return build()
    except Exception:  # a factory that computes with its weights: build it for real, on the CPU
        pass
    with building(key, cfg.model.factory), torch.device("cpu"):
        return build()
