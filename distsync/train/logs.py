"""One rank-aware logger: rank 0 talks to the console, every rank writes ``<run_dir>/logs/rank<N>.log``."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

__all__ = ["init_logger", "console_quiet", "logger"]

logger = logging.getLogger("distsync.train")


def init_logger(run_dir: str | os.PathLike, rank: int, console: bool | None = None) -> logging.Logger:
    """Point :data:`logger` at this rank's file (and the console on rank 0); idempotent per process."""
    console = rank == 0 if console is None else console
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    path = Path(run_dir) / "logs" / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter(f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s"))
    logger.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stdout)
        stream.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(stream)
    return logger


@contextlib.contextmanager
def console_quiet(enabled: bool = True):
    """While active, INFO records reach only the rank's file (a progress bar owns the console)."""
    streams = [h for h in logger.handlers if type(h) is logging.StreamHandler] if enabled else []
    levels = [h.level for h in streams]
    for h in streams:
        h.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for h, level in zip(streams, levels, strict=True):
            h.setLevel(level)
