"""The job's pieces built from its config, with errors that name the config key they come from.

Building the datasets, the model, the loss, the optimizer and the schedule fails the same way on every
rank and on every attempt when the config is wrong: a factory that raises, a keyword a ``**kwargs``
factory passes on to a constructor that rejects it, a batch larger than a rank's share of the data.
:func:`check_buildable` builds them once in the launching process (the model on the meta device), so that
such an error costs one line before any worker starts; :func:`building` gives the workers' own build the
same messages, for the errors that only show there.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from distsync.train.config import ConfigError, TrainConfig
from distsync.train.data import batches_per_epoch, load_data
from distsync.train.model import build_model
from distsync.train.optim import build_optimizer, build_scheduler
from distsync.train.streaming import first_input
from distsync.train.targets import TARGET, instantiate

__all__ = ["building", "check_buildable", "check_builtin_data"]


@contextlib.contextmanager
def building(key: str, node: dict | None = None) -> Iterator[None]:
    """An exception raised while building ``key`` (from ``node``), as a one-line :class:`ConfigError`."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:
        target = f" ({node[TARGET]})" if node and TARGET in node else ""
        lines = str(error).strip().splitlines()
        cause = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        raise ConfigError(f"{key}{target}: {cause}") from error


def check_buildable(cfg: TrainConfig, world_size: int) -> None:
    """Build every piece of the job once, here, and raise :class:`ConfigError` naming what fails.

    The datasets are built as the workers build them; the model on the meta device (no memory, no
    initialization), or on the CPU for a factory that cannot run on meta; the optimizer and the schedule
    over its parameters.
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
