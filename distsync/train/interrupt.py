"""Ctrl-C and SIGTERM while training: noted, and acted on by every rank together with a checkpoint.

Each rank notes the signal and trains on; at the next logging step the all-reduce of the logged loss tells
every rank whether any was asked to stop, and then all save that step and end as the signal meant (exit
code 130 or 143). See docs/training.md, "Fault tolerance".
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, NoReturn

__all__ = ["StopRequests"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """While entered (in the main thread), SIGINT and SIGTERM are noted in :attr:`signum` instead of ending
    the process; the previous handlers come back on exit."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._note) for signum in _SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _note(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def end(self, step: int, log: logging.Logger) -> NoReturn:
        """End this rank after the stop's checkpoint: KeyboardInterrupt for Ctrl-C, else SystemExit(128 +
        the signal) (SIGTERM for a rank that only learned of its peers' signal)."""
        signum = self.signum or signal.SIGTERM
        log.warning(
            "stopped by %s at step %d, after saving a checkpoint there: the same run directory resumes it",
            signal.Signals(signum).name,
            step,
        )
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)
