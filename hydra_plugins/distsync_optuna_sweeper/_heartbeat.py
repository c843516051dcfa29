"""Whether the sweep that runs a trial is alive: a heartbeat in the study itself, so on every storage.

Optuna decides that a trial is stale from a heartbeat (``heartbeat_interval``, ``grace_period``): a trial
whose last heartbeat is older than ``grace_period`` seconds belongs to a process that is gone. Optuna's
own heartbeat (RDB storages only) is written by the process that runs the trial; a trial of this sweeper
runs in a job of its own (a SLURM job, a torchrun world) that may outlive the sweep, and the sweep is what
must be replaced. So the heartbeat is the sweep's: every sweep has an id, the trials it runs carry it (the
user attribute ``distsync_sweep``), and while it runs it writes the time into the study's system
attributes (``distsync_heartbeat:<id>``) every ``heartbeat_interval`` seconds. A sweep that ends, however
(done, Ctrl-C, SIGTERM, an error), writes 0 as it ends, so its unfinished trials are stale at once; a sweep
killed with SIGKILL, or lost with its node or its requeued job, stops writing, and its trials are stale
``grace_period`` seconds after its last heartbeat, whatever host, container or PID namespace the next sweep
runs in. The hosts' clocks must agree to well within ``grace_period``, as for Optuna's heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from types import TracebackType
from typing import Any

from optuna.trial import FrozenTrial

log = logging.getLogger(__name__)

OWNER = "distsync_sweep"  # user attribute of a trial: the id of the sweep that runs it
_BEAT = "distsync_heartbeat:"  # study system attribute, + a sweep's id: the time of its last heartbeat


class Heartbeat:
    """This sweep's id (:attr:`sweep_id`) and, as a context manager, its heartbeat in the study."""

    def __init__(self, storage: Any, study_id: int, interval: float) -> None:
        self.storage, self.study_id, self.interval = storage, study_id, interval
        self.sweep_id = uuid.uuid4().hex[:16]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        self._beat(time.time())
        self._thread = threading.Thread(target=self._run, name="distsync-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._beat(0.0)  # ended: whatever it leaves running is the next sweep's at once

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat(time.time())

    def _beat(self, when: float) -> None:
        try:
            self.storage.set_study_system_attr(self.study_id, _BEAT + self.sweep_id, when)
        except Exception as error:  # noqa: BLE001  the storage is unreachable for now: beat again later
            log.warning(f"the sweep's heartbeat could not be written: {error!r}")


def owner(trial: FrozenTrial) -> str | None:
    """The id of the distsync sweep that runs ``trial`` (None: not a distsync sweep's trial)."""
    found = trial.user_attrs.get(OWNER)
    return str(found) if found else None


def silent_for(trial: FrozenTrial, study_system_attrs: dict[str, Any], now: float) -> float | None:
    """Seconds since the last heartbeat of the sweep that runs ``trial``: ``inf`` for a sweep that ended
    or never wrote one (a sweep of an older distsync); None for a trial no distsync sweep runs."""
    sweep = owner(trial)
    if sweep is None:
        return None
    beat = study_system_attrs.get(_BEAT + sweep)
    return float("inf") if not beat else max(0.0, now - float(beat))
