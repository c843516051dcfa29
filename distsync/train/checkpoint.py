"""Atomic checkpoints in ``<run_dir>/checkpoints/`` and the RNG state they carry.

Rank 0 writes ``step_<NNNNNNNN>.pt`` through a temporary file and ``os.replace``, so a worker killed
mid-write leaves the previous checkpoint intact; every rank's RNG state is gathered into it. A save that
fails (a full disk) removes its temporary file, and :func:`remove_stale_temporaries` clears the ones a
killed writer left, so a full disk does not stay full across restarts. :func:`load_newest_checkpoint`
falls back to an older checkpoint when the newest does not load.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "checkpoint_dir",
    "save_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_newest_checkpoint",
    "remove_stale_temporaries",
    "rng_state",
    "set_rng_state",
]

_NAME = re.compile(r"^step_(\d+)\.pt$")
_TMP = re.compile(r"^\.step_\d+\.pt\.\d+\.tmp$")
REQUIRED_KEYS = ("step", "model", "optimizer", "scheduler", "batches", "rng", "config")
"""What a checkpoint must hold to be resumed from."""
CORRUPT_SUFFIX = ".corrupt"
"""Appended to the name of a checkpoint that does not load, which takes it out of the rotation."""


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically and keep only the ``keep`` newest.

    If writing fails (``OSError`` such as ``ENOSPC``, or anything else) the temporary file is removed
    before the error propagates, so the space it took is given back.
    """
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
        tmp.unlink(missing_ok=True)
        raise
    for old in _checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of checkpoint saves that were killed mid-write; return them.

    Only safe while no other process writes checkpoints into ``run_dir`` (hold its
    :class:`~distsync.train.rundir.RunDirLock`).
    """
    directory = checkpoint_dir(run_dir)
    stale = [p for p in directory.iterdir() if _TMP.match(p.name)] if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step in ``run_dir``, or None."""
    found = _checkpoints(checkpoint_dir(run_dir))
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` onto the CPU.

    It holds NumPy RNG state, so it is loaded with ``weights_only=False``: only load your own run's files.
    """
    return torch.load(path, map_location="cpu", weights_only=False)


def load_newest_checkpoint(
    run_dir: str | os.PathLike, log: logging.Logger | None = None
) -> tuple[Path, dict] | None:
    """The newest checkpoint in ``run_dir`` that loads, as ``(path, state)``; None if none does.

    A checkpoint that does not load (truncated, empty, garbage, or not a checkpoint) is renamed to
    ``<name>.corrupt`` (``.corrupt.1`` ... if that exists), kept for inspection but out of the rotation (it
    would otherwise count towards ``keep`` and push good checkpoints out), and logged as a warning with the
    reason. Call it on one rank
    only, while holding the run directory's lock.
    """
    for path in reversed(_checkpoints(checkpoint_dir(run_dir))):
        try:
            state = load_checkpoint(path)
            missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
            if missing:
                raise ValueError(f"not a distsync checkpoint (missing {', '.join(missing)})")
            return path, state
        except Exception as error:  # any way a file can fail to unpickle
            aside = _unused(path.with_name(path.name + CORRUPT_SUFFIX))
            os.replace(path, aside)
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            if log is not None:
                log.warning(
                    "skipped checkpoint %s (%s: %s), renamed to %s; trying the previous one",
                    path.name,
                    type(error).__name__,
                    reason,
                    aside.name,
                )
    return None


def _unused(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ... : the first that does not exist (an earlier one is kept)."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


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
