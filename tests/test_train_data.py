"""Datasets, resumable sharded batches and checkpoints of distsync.train, single-process."""

from __future__ import annotations

import itertools
import sys

import torch
from launching import run_job
from torch.utils.data import TensorDataset

from distsync.train import DataConfig
from distsync.train import data as train_data
from distsync.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from distsync.train.data import LoaderBatches, load_data, shard_indices


def test_digits_split_is_deterministic_and_stratified():
    (train_x, train_y), (test_x, test_y), classes = load_data(DataConfig())
    assert classes == 10 and train_x.shape[1:] == (1, 8, 8)
    assert len(train_y) + len(test_y) == 1797
    assert abs(len(test_y) / 1797 - 0.2) < 0.01
    assert set(test_y.tolist()) == set(range(10))
    again = load_data(DataConfig())
    assert torch.equal(again[1][0], test_x)


def test_digits_are_scikit_learns_read_without_importing_it(tmp_path):
    """The launcher's check, the fork server and the ranks build the digits: none of them pays for
    importing sklearn.datasets (about 1.7 s of CPU), and the images and labels are load_digits' own."""
    code = (
        "import sys, torch\n"
        "from distsync.train.data import _digits\n"
        "images, labels, classes = _digits()\n"
        "assert 'sklearn' not in sys.modules, 'imported sklearn'\n"
        "from sklearn.datasets import load_digits\n"
        "bunch = load_digits()\n"
        "assert classes == 10 and images.dtype == torch.float32 and labels.dtype == torch.int64\n"
        "assert torch.equal(images, torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16)\n"
        "assert torch.equal(labels, torch.as_tensor(bunch.target))\n"
    )
    proc = run_job([sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_digits_come_from_load_digits_where_the_file_is_elsewhere(monkeypatch):
    bundled = train_data._digits()
    monkeypatch.setattr(train_data, "_bundled_digits", lambda: None)
    asked = train_data._digits()
    assert asked[2] == bundled[2] == 10
    assert torch.equal(asked[0], bundled[0]) and torch.equal(asked[1], bundled[1])


def test_synthetic_data():
    (x, y), (tx, ty), classes = load_data(
        DataConfig(name="synthetic", num_samples=300, num_classes=3, image_size=6)
    )
    assert classes == 3 and x.shape[1:] == (1, 6, 6) and len(y) + len(ty) == 300


def test_shards_are_disjoint_and_resume_exactly():
    data = TensorDataset(*load_data(DataConfig())[0])  # the built-in data, as the job batches it
    world = 2
    shards = [LoaderBatches(data, 16, r, world, seed=3) for r in range(world)]
    first = [next(iter(s))[1] for s in shards]
    assert first[0].shape == (16,)
    reference = LoaderBatches(data, 16, 0, world, seed=3)
    expected = [y for _, y in itertools.islice(iter(reference), 2 * reference.batches_per_epoch + 5)]
    resumed = LoaderBatches(data, 16, 0, world, seed=3)
    consumed = list(itertools.islice(iter(resumed), reference.batches_per_epoch + 3))
    state = resumed.state_dict()
    assert state == {"epoch": 1, "batch": 3}
    fresh = LoaderBatches(data, 16, 0, world, seed=3)
    fresh.load_state_dict(state)
    rest = [y for _, y in itertools.islice(iter(fresh), len(expected) - len(consumed))]
    assert all(torch.equal(a, b) for a, b in zip(expected, [y for _, y in consumed] + rest, strict=True))
    assert not torch.equal(expected[0], expected[reference.batches_per_epoch])  # set_epoch reshuffles


def test_eval_shards_cover_every_sample_once():
    parts = [shard_indices(11, r, 3) for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(11))


def test_checkpoints_are_atomic_pruned_and_newest_wins(tmp_path):
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step, {"step": step, "rng": [rng_state()]}, keep=2)
    (tmp_path / "checkpoints" / ".step_00000020.pt.123.tmp").write_bytes(b"partial")
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    assert names == ["step_00000010.pt", "step_00000015.pt"]
    newest = latest_checkpoint(tmp_path)
    assert newest.name == "step_00000015.pt" and load_checkpoint(newest)["step"] == 15
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
