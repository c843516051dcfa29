"""Streaming training data: an ``IterableDataset`` that shards itself per rank, with uneven batch counts.

Each pass is one stretch under DDP's ``Join`` (:func:`distsync.joinable`): a rank that runs out shadows the
others' collectives until the pass ends. The job's own collectives (logs, evaluation, checkpoints,
``check_sync``) wait for the pass boundary, where the ranks agree on the step. docs/training.md, "Streaming
data with uneven shards", says what a user sees.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.algorithms.join import Join
from torch.utils.data import DataLoader, IterableDataset

import distsync
from distsync.distributed import is_distributed
from distsync.train.collectives import all_reduce
from distsync.train.config import ConfigError, TrainConfig

__all__ = ["Stretch", "StreamBatches", "check_streaming", "first_input", "is_stream"]


class Stretch(NamedTuple):
    """Steps to take under ``context``; each item of ``steps`` feeds one optimizer step its micro-batches."""

    context: contextlib.AbstractContextManager
    steps: Iterator[Iterator[tuple[Tensor, Tensor]]]


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a streaming one: an ``IterableDataset``."""
    return isinstance(dataset, IterableDataset)


def check_streaming(cfg: TrainConfig) -> None:
    """Refuse the settings a streaming ``data.train`` does not support (:class:`ConfigError`).

    Called once the dataset is built: before any worker starts (:func:`.build.check_buildable`), and in
    every worker (the same config and dataset on every rank, so every rank raises the same error).
    """
    t = cfg.trainer
    refused = {
        "trainer.grad_accum_steps": (t.grad_accum_steps != 1, "must be 1"),
        "trainer.compile": (t.compile, "must be false"),
        "trainer.local_sgd_period": (t.local_sgd_period != 0, "must be 0"),
        "trainer.comm_hook": (t.comm_hook != "none", "must be none"),
    }
    for key, (bad, rule) in refused.items():
        if bad:
            value = getattr(t, key.split(".")[1])
            raise ConfigError(
                f"{key}: {rule} with a streaming data.train (an IterableDataset, trained under DDP's Join), "
                f"got {value}"
            )


def first_input(dataset: Any) -> Tensor:
    """The input of the first sample of a map-style or streaming dataset (for the model's width)."""
    if is_stream(dataset):
        return next(iter(dataset))[0]
    return dataset[0][0]


class StreamBatches:
    """This rank's batches of a streaming dataset, one pass per iteration.

    Full batches of ``batch_size`` from a ``DataLoader`` over the dataset (the last partial batch of a
    pass is dropped). ``epoch`` counts the passes begun before this one; a dataset with ``set_epoch`` is
    told the pass number, so it can reshuffle. :meth:`state_dict` is the pass: a resumed run starts the
    next pass from its beginning. With ``num_workers > 0`` the dataset must also split its stream among
    the DataLoader workers (``torch.utils.data.get_worker_info()``), or each worker yields all of it.

    Args:
        dataset: an ``IterableDataset`` of ``(input, label)`` pairs that yields this rank's share
        batch_size: samples per rank per step
        num_workers: DataLoader worker processes
        device: where the ranks agree at the end of a pass (the process group's device); batches are
            page-locked for a GPU
    """

    def __init__(
        self, dataset: IterableDataset, batch_size: int, num_workers: int = 0, device: Any = "cpu"
    ) -> None:
        self.dataset, self.device = dataset, torch.device(device)
        pin_memory = self.device.type == "cuda"
        self.loader = DataLoader(
            dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory, drop_last=True
        )
        self.epoch = 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        yield from self.loader

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": 0}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])  # a checkpoint of a streaming run is always at a pass boundary

    def stretches(self, model) -> Iterator[Stretch]:
        """One stretch per pass, under ``Join`` on several ranks: a rank whose stream ends first shadows the
        others' collectives (DDP's and the synchronized layers', through :func:`distsync.joinable`)."""
        layers = distsync.joinable(model) if is_distributed() else None  # on every rank, before a step
        while True:
            join = Join([layers, model]) if layers is not None else contextlib.nullcontext()
            yield Stretch(join, (iter([batch]) for batch in self))

    def agree(self, start: int, step: int, losses: list[tuple[int, Tensor]], keep: int) -> tuple[int, dict]:
        """The largest step any rank reached in the pass, and each of its last ``keep`` steps' mean loss over
        the ranks that took it (NaN for none), the same on every rank (so ``final_loss``, a mean over
        ranks, is the mean over the steps). Raises :class:`ConfigError` on every rank if no rank had a full
        batch in the pass."""
        reached = torch.tensor([step], dtype=torch.int64, device=self.device)
        all_reduce(reached, torch.distributed.ReduceOp.MAX)
        agreed = int(reached.item())
        if agreed == start:  # the same on every rank
            raise ConfigError(
                f"data.train: no rank had a full batch of data.batch_size={self.loader.batch_size} in pass "
                f"{self.epoch}"
            )
        self.epoch += 1  # a checkpoint from here resumes at the next pass
        first = max(start, agreed - keep) + 1
        sums = torch.zeros(agreed - first + 1, 2, dtype=torch.float64, device=reached.device)
        for at, loss in losses:
            if at >= first:
                sums[at - first] = torch.stack([loss.double(), loss.new_ones((), dtype=torch.float64)])
        all_reduce(sums)
        return agreed, {
            first + i: total / count if count else math.nan for i, (total, count) in enumerate(sums.tolist())
        }
