"""Streaming training data: an ``IterableDataset`` that shards itself per rank, with uneven batch counts.

A streaming dataset (webdataset's ``split_by_node``, a Hugging Face ``IterableDataset`` split by node,
yours reading ``torch.distributed.get_rank()`` as it iterates) gives each rank its own stream, and the
ranks different numbers of batches per pass. The job trains pass after pass. Within a pass every rank
steps on its own batches; a rank that runs out joins (DDP's ``Join`` with :func:`distsync.joinable`):
it shadows the others' collectives, DDP's gradient all-reduces and the synchronized layers' all-reduces
with empty batches, until every rank is done with the pass or ``trainer.max_steps`` is reached. The ranks
still training step together, so they reach ``max_steps`` together.

The job's other collectives (the loss of the logs, evaluation, checkpoint gathers, ``check_sync``) cannot
run while a rank is joined, so they move to the pass boundaries: each happens at the first boundary at or
after the step it was due. There the ranks agree on the step count (the largest), and a rank that joined
brings its LR schedule to that step; DDP's join hook has given every rank the last joiner's parameters. A
rank's optimizer state (momentum) stays its own: it missed the steps it was joined for (as with any use
of ``Join``). A resumed run starts a new pass at the checkpointed step: a stream position cannot be
restored.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.distributed.algorithms.join import Join
from torch.utils.data import DataLoader, IterableDataset

import distsync
from distsync.distributed import is_distributed

from .collectives import all_reduce
from .config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["StreamBatches", "check_streaming", "first_input", "is_stream", "train_streaming"]


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` (or a dataset class) is a streaming one: an ``IterableDataset``."""
    if isinstance(dataset, type):
        return issubclass(dataset, IterableDataset)
    return isinstance(dataset, IterableDataset)


def check_streaming(cfg: TrainConfig) -> None:
    """Refuse the settings a streaming ``data.train`` does not support (:class:`ConfigError`).

    Called before any worker starts when ``data.train``'s target is an ``IterableDataset`` class, and
    again in every worker once the dataset is built (a factory function may return one): the same
    config and dataset on every rank, so every rank raises the same error.
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
        pin_memory: page-locked batches, for a GPU
    """

    def __init__(self, dataset: IterableDataset, batch_size: int, num_workers: int = 0, pin_memory=False):
        self.dataset = dataset
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


def train_streaming(trainer: Trainer, bar) -> None:
    """The training loop of a streaming run: passes until ``trainer.max_steps``, with the logs, evaluations
    and checkpoints at the pass boundaries (see the module docstring)."""
    t = trainer.cfg.trainer
    batches: StreamBatches = trainer.batches
    layers = distsync.joinable(trainer.ddp) if is_distributed() else None  # on every rank, before a step
    loss_sum = torch.zeros(2, dtype=torch.float64, device=trainer.device)  # sum of losses, count
    trainer.ddp.train()
    while trainer.step < t.max_steps and trainer.pruned_at is None:
        start = trainer.step
        losses = _one_pass(trainer, layers, bar)
        for _, loss in losses:
            loss_sum += torch.stack([loss, loss.new_ones(())])
        step = torch.tensor([trainer.step], dtype=torch.int64, device=trainer.device)
        all_reduce(step, torch.distributed.ReduceOp.MAX)
        step = int(step.item())
        if step == start:  # the same on every rank: no rank had a full batch in this pass
            raise ConfigError(
                f"data.train: no rank had a full batch of data.batch_size={trainer.cfg.data.batch_size} "
                f"in pass {batches.epoch}"
            )
        for _ in range(step - trainer.step):  # a joined rank's schedule catches up: the LRs agree
            trainer.scheduler.step()
        trainer.step = step
        batches.epoch += 1  # a checkpoint from here resumes at the next pass
        _record_recent_losses(trainer, losses, start)
        _at_boundary(trainer, start, loss_sum, bar)


def _one_pass(trainer: Trainer, layers, bar) -> list[tuple[int, Tensor]]:
    """This rank's steps of one pass, under ``Join``; returns its ``(step, loss)`` pairs."""
    t = trainer.cfg.trainer
    losses: list[tuple[int, Tensor]] = []
    join = Join([layers, trainer.ddp]) if layers is not None else contextlib.nullcontext()
    with join:
        for batch in trainer.batches:
            if trainer.step >= t.max_steps:  # the ranks still training get here together
                break
            loss = trainer._train_step(iter([batch]))
            trainer.scheduler.step()
            trainer.step += 1
            losses.append((trainer.step, loss.detach().double()))
            if bar is not None:
                bar.update(1)
    return losses


def _record_recent_losses(trainer: Trainer, losses: list[tuple[int, Tensor]], start: int) -> None:
    """Each step's mean loss over the ranks that took it, for ``final_loss`` and the logs; the same on every
    rank (so ``final_loss``, a mean over ranks, is the mean over the steps)."""
    from .trainer import FINAL_LOSS_STEPS

    first = max(start, trainer.step - FINAL_LOSS_STEPS) + 1
    sums = torch.zeros(trainer.step - first + 1, 2, dtype=torch.float64, device=trainer.device)
    for step, loss in losses:
        if step >= first:
            sums[step - first] = torch.stack([loss, loss.new_ones(())])
    all_reduce(sums)
    for i, (total, count) in enumerate(sums.tolist()):
        trainer.recent_losses[(first + i) % FINAL_LOSS_STEPS] = total / count if count else math.nan


def _at_boundary(trainer: Trainer, start: int, loss_sum: Tensor, bar) -> None:
    """The logs, evaluation and checkpoint that fell due in ``(start, step]``, once each, at this step."""
    t, step = trainer.cfg.trainer, trainer.step

    def due(every: int) -> bool:
        return step // every > start // every

    distsync.check_sync()
    if due(t.log_every) or step == t.max_steps:
        trainer._log_train(loss_sum, bar)  # the mean loss of every rank's steps since the last log
        loss_sum.zero_()
    if due(t.eval_every) and step < t.max_steps and trainer.pruned(trainer._evaluate()):
        return
    if due(t.checkpoint_every) or step == t.max_steps:
        trainer._checkpoint()
