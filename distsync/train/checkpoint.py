"""Atomic checkpoints in ``<run_dir>/checkpoints/`` and the RNG state they carry.

Rank 0 writes ``step_<NNNNNNNN>.pt`` through a temporary file and ``os.replace``, so a worker killed
mid-write leaves the previous checkpoint intact; every rank's RNG state is gathered into it.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "checkpoint_dir",
    "save_checkpoint",
    "newest_loadable_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]

_NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically and keep only the ``keep`` newest."""
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:08d}.pt"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not stay full of a partial checkpoint
        raise
    for old in _checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def _checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def newest_loadable_checkpoint(
    run_dir: str | os.PathLike, skipped: Callable[[Path, Exception], None]
) -> tuple[Path, dict] | None:
    """The newest checkpoint of ``run_dir`` that loads, and its state; ``skipped(path, error)`` hears of
    each newer one that did not.

    A truncated, empty or garbled newest file (a crash or a full disk mid-write by other means than
    :func:`save_checkpoint`) then costs the steps since the previous checkpoint, not the run.
    """
    for path in reversed(_checkpoints(checkpoint_dir(run_dir))):
        try:
            return path, load_checkpoint(path)
        except Exception as error:  # any unreadable file: fall back to an older one
            skipped(path, error)
    return None


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` onto the CPU.

    It holds NumPy RNG state, so it is loaded with ``weights_only=False``: only load your own run's files.
    """
    return torch.load(path, map_location="cpu", weights_only=False)


def rng_state() -> dict:
    """This process's Python, NumPy, torch CPU (and CUDA) generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
