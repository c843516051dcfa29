"""A dataset as slow to read as a disk or a network makes one: the tests' jobs that must still be training
when the test acts on them (a signal, a requeue, a cancelled or taken-over trial) train for a known wall time.

The packaged job's synthetic data (``data=synthetic``), given to a job as ``data.train``/``data.test``
``_target_`` nodes (:data:`PACED`), each training batch taking at least ``seconds_per_batch`` to read. A
trial of ``N`` steps then lasts ``N * seconds_per_batch`` or more on any machine, however fast its steps,
and spends most of it asleep, leaving the cores to the tests that run beside it; counted in steps alone,
such a trial had to be thousands of steps long to outlast a loaded machine's reaction, and a fast machine
still ran through it before the test acted. ``DataLoader`` reads a batch with one :meth:`__getitems__`
call: one sleep per batch.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

from distsync.train.config import DataConfig
from distsync.train.data import load_data

SECONDS_PER_BATCH = 0.05


def paced(seconds_per_batch: float) -> list[str]:
    """Overrides of the packaged job (Hydra's command line) that make its training data paced, each batch
    read in at least ``seconds_per_batch``; the job's processes import this module (``launching.job_env``
    puts the tests' folder on their PYTHONPATH)."""
    return [
        "data.num_workers=0",  # read by the rank itself, which then sleeps
        "+data.train._target_=paced_data.PacedSynthetic",
        "+data.train.split=train",
        f"+data.train.seconds_per_batch={seconds_per_batch}",
        "+data.test._target_=paced_data.PacedSynthetic",
        "+data.test.split=test",
    ]


PACED = paced(SECONDS_PER_BATCH)


class PacedSynthetic(Dataset):
    """The ``train`` or ``test`` split of the job's default synthetic data, each batch read in at least
    ``seconds_per_batch`` (0: at once)."""

    def __init__(self, split: str, seconds_per_batch: float = 0.0) -> None:
        train, test, _ = load_data(DataConfig(name="synthetic"))
        self.images, self.labels = {"train": train, "test": test}[split]
        self.seconds_per_batch = seconds_per_batch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.seconds_per_batch:
            time.sleep(self.seconds_per_batch)
        return [self[index] for index in indices]
