"""Checkpoint files: fallback past corrupt ones, no temporary file left behind by a failed save."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from distsync.train import checkpoint as ckpt
from distsync.train.checkpoint import (
    checkpoint_dir,
    load_newest_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)


def _state(step: int) -> dict:
    return {key: {} for key in ckpt.REQUIRED_KEYS} | {"step": step, "model": {"w": torch.full((4,), step)}}


def _corrupt(path, how: str) -> None:
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"\x00not a checkpoint\xff" * 50)
    elif how == "not-a-checkpoint":
        torch.save({"step": 3}, path)


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "not-a-checkpoint"])
def test_falls_back_to_the_newest_checkpoint_that_loads(tmp_path, caplog, how):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, _state(step), keep=5)
    _corrupt(checkpoint_dir(tmp_path) / "step_00000030.pt", how)
    with caplog.at_level(logging.WARNING):
        path, state = load_newest_checkpoint(tmp_path, logging.getLogger("test"))
    assert path.name == "step_00000020.pt" and state["step"] == 20
    assert torch.equal(state["model"]["w"], torch.full((4,), 20))
    [record] = caplog.records
    assert "step_00000030.pt" in record.getMessage() and "skipped" in record.getMessage()
    # Out of the rotation, kept for inspection: a later save cannot prune a good checkpoint for it.
    names = sorted(p.name for p in checkpoint_dir(tmp_path).iterdir())
    assert names == ["step_00000010.pt", "step_00000020.pt", "step_00000030.pt.corrupt"]


def test_no_checkpoint_loads(tmp_path):
    assert load_newest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 10, _state(10), keep=2)
    _corrupt(checkpoint_dir(tmp_path) / "step_00000010.pt", "empty")
    assert load_newest_checkpoint(tmp_path) is None
    # The same step corrupt again (a rerun that crashed mid-save): the first one kept is not overwritten.
    save_checkpoint(tmp_path, 10, _state(10), keep=2)
    _corrupt(checkpoint_dir(tmp_path) / "step_00000010.pt", "garbage")
    assert load_newest_checkpoint(tmp_path) is None
    names = sorted(p.name for p in checkpoint_dir(tmp_path).iterdir())
    assert names == ["step_00000010.pt.corrupt", "step_00000010.pt.corrupt.1"]


def test_a_failed_save_removes_its_temporary_file(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 10, _state(10), keep=2)
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"x" * 4096)  # a partial file, as a full disk leaves it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 20, _state(20), keep=2)
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in checkpoint_dir(tmp_path).iterdir()] == ["step_00000010.pt"]
    assert load_newest_checkpoint(tmp_path)[1]["step"] == 10


def test_stale_temporaries_of_a_killed_save_are_removed(tmp_path):
    save_checkpoint(tmp_path, 10, _state(10), keep=2)
    stale = checkpoint_dir(tmp_path) / ".step_00000020.pt.12345.tmp"
    stale.write_bytes(b"x" * 1000)
    assert remove_stale_temporaries(tmp_path) == [stale]
    assert [p.name for p in checkpoint_dir(tmp_path).iterdir()] == ["step_00000010.pt"]
