"""Datasets that need no download, and resumable per-rank batches over a ``DistributedSampler``.

The training loop (:meth:`distsync.train.trainer.Trainer.fit`) asks its batch source for *stretches*: the
steps a rank takes between two points where every rank meets. Within a stretch the job makes no collective
of its own (the model's, DDP's and the synchronized layers' still run), so its logs, evaluations and
checkpoints wait for the stretch's end, where the ranks agree on the step they reached (``agree``). The
map-style sources here give stretches of one step each, and agreeing costs nothing; a stream gives one
stretch per pass, under DDP's ``Join`` (:mod:`distsync.train.streaming`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from distsync.train.config import ConfigError, DataConfig
from distsync.train.streaming import Stretch
from distsync.train.targets import instantiate

__all__ = [
    "Split",
    "load_data",
    "build_datasets",
    "LoaderBatches",
    "eval_batches",
    "shard_indices",
]

Split = tuple[Tensor, Tensor]
"""Images ``(N, C, H, W)`` as float32 and labels ``(N,)`` as int64."""


def load_data(cfg: DataConfig) -> tuple[Split, Split, int]:
    """Train split, held-out split and number of classes; deterministic in ``cfg`` (same on every rank)."""
    images, labels, num_classes = _digits() if cfg.name == "digits" else _synthetic(cfg)
    train_idx, test_idx = _stratified_split(labels, cfg.test_fraction, cfg.split_seed)
    train_x, test_x = images[train_idx], images[test_idx]
    mean, std = train_x.mean(), train_x.std().clamp_min(1e-6)
    return ((train_x - mean) / std, labels[train_idx]), ((test_x - mean) / std, labels[test_idx]), num_classes


def _digits() -> tuple[Tensor, Tensor, int]:
    """scikit-learn's 8x8 digits: images scaled to [0, 1], labels, 10 classes.

    Read from the file scikit-learn ships them in, found without importing scikit-learn: importing
    ``sklearn.datasets`` (scipy.stats, pandas) costs about 1.7 s of CPU in every process that builds the
    data, the launcher's check and the fork server included, where reading the file takes 0.1 s. A
    scikit-learn that keeps the file elsewhere is asked through its API, ``load_digits``.
    """
    table = _bundled_digits()
    if table is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, labels = torch.as_tensor(bunch.data), torch.as_tensor(bunch.target)
    else:
        pixels, labels = table[:, :-1], table[:, -1]
    images = pixels.to(torch.float32).view(-1, 1, 8, 8) / 16.0
    return images, labels.to(torch.int64), 10


def _bundled_digits() -> Tensor | None:
    """The rows of scikit-learn's ``datasets/data/digits.csv.gz`` (64 pixels and the label, float64), or None
    where scikit-learn is not installed as a folder that holds it."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            import numpy

            return torch.from_numpy(numpy.loadtxt(path, delimiter=",", ndmin=2))
    return None


def _synthetic(cfg: DataConfig) -> tuple[Tensor, Tensor, int]:
    gen = torch.Generator().manual_seed(cfg.split_seed)
    size = cfg.image_size
    templates = torch.randn(cfg.num_classes, 1, size, size, generator=gen)
    labels = torch.randint(cfg.num_classes, (cfg.num_samples,), generator=gen)
    noise = cfg.noise * torch.randn(cfg.num_samples, 1, size, size, generator=gen)
    return templates[labels] + noise, labels, cfg.num_classes


def _stratified_split(labels: Tensor, test_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    train, test = [], []
    for cls in labels.unique():
        idx = (labels == cls).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        n_test = round(len(idx) * test_fraction)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def shard_indices(n: int, rank: int, world_size: int) -> Tensor:
    """This rank's share of ``range(n)`` for evaluation: every sample exactly once over all ranks."""
    return torch.arange(rank, n, world_size)


def batches_per_epoch(per_rank: int, batch_size: int, world_size: int, total: int) -> int:
    """Full batches per epoch of a rank's ``per_rank`` samples; refuses a batch larger than them."""
    if per_rank // batch_size == 0:
        raise ConfigError(
            f"data.batch_size must be at most {per_rank} with {world_size} ranks "
            f"({total} training samples) (got {batch_size})"
        )
    return per_rank // batch_size


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset, int]:
    """The training and held-out datasets and the number of classes: those of ``data.train`` /
    ``data.test`` (``_target_`` nodes), or the built-in data of :func:`load_data` as ``TensorDataset`` s."""
    if cfg.train:
        return instantiate(cfg.train), instantiate(cfg.test), cfg.num_classes
    train, test, num_classes = load_data(cfg)
    return TensorDataset(*train), TensorDataset(*test), num_classes


class _ResumableSampler(Sampler[int]):
    """A :class:`DistributedSampler`'s order for one epoch, from a given sample on."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler, self.start = sampler, 0

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.sampler)[self.start :])

    def __len__(self) -> int:
        return len(self.sampler) - self.start


class LoaderBatches:
    """Endless per-rank training batches of a map-style dataset, epoch after epoch, resumable mid-epoch.

    A :class:`DistributedSampler` (shuffled with ``seed``, ``set_epoch`` every epoch, tail dropped so
    every rank gets the same number of samples) picks this rank's samples; a ``DataLoader``
    (``num_workers`` processes) cuts full batches of ``batch_size`` from them, so every rank takes the same
    number of steps per epoch. :meth:`state_dict` is the position ``(epoch, batch)``: a resumed run sees
    exactly the batches it would have seen. The training loop's stretches are single steps, which every
    rank takes together.

    Args:
        dataset: ``(input, label)`` pairs (the built-in data as a ``TensorDataset``)
        batch_size: samples per rank per step
        rank: this rank
        world_size: number of ranks
        seed: shuffling seed, the same on every rank
        num_workers: DataLoader worker processes
        pin_memory: page-locked batches, for a GPU
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.batches_per_epoch = batches_per_epoch(len(sampler), batch_size, world_size, len(dataset))
        self.sampler = _ResumableSampler(sampler)
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            drop_last=True,
        )
        self.batch_size, self.epoch, self.batch = batch_size, 0, 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            self.sampler.sampler.set_epoch(self.epoch)
            self.sampler.start = self.batch * self.batch_size
            for inputs, labels in self.loader:
                self.batch += 1
                yield inputs, labels
                if self.batch == self.batches_per_epoch:
                    break
            self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def stretches(self, model) -> Iterator[Stretch]:
        """Endless stretches of one step each; ``model`` is the module they call (DDP on several ranks)."""
        batches = iter(self)
        while True:
            yield Stretch(contextlib.nullcontext(), iter([batches]))  # the step draws what it needs

    def agree(self, start: int, step: int, losses: list[tuple[int, Tensor]], keep: int) -> tuple[int, dict]:
        """At a stretch's end, begun at ``start``, this rank at ``step`` with its ``(step, loss)`` pairs: the
        step every rank is at now, and the loss to remember for each of the last ``keep`` steps."""
        return step, dict(losses)  # every rank took this step: nothing to agree on, no collective


def eval_batches(test: Dataset, rank: int, world_size: int, batch_size: int, num_workers: int = 0):
    """This rank's share of the map-style held-out dataset in batches: every sample once over all ranks."""
    share = Subset(test, shard_indices(len(test), rank, world_size).tolist())
    return DataLoader(share, batch_size=batch_size, num_workers=num_workers)
