"""Deferred desync and bad-input checks for synchronized calls on accelerators.

Reading a reduced payload on the host would stall a GPU's queue once per layer and direction. On devices
other than the CPU, each call instead leaves its reduced tail here; every ``_COPY_EVERY`` calls the pending
tails are copied without blocking into pinned host memory, behind a CUDA event. Every later synchronized
call polls that event (never waits on it) and raises the first error it finds; :func:`check_sync` waits
for everything still pending. The tails are identical on every rank, so every rank raises the same error.
Running statistics are protected on the device meanwhile (see ``_moments.running_stat_weight``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _moments
from ._identity import CallTag

__all__ = ["check_sync"]

_COPY_EVERY = 8


@dataclass
class _Pending:
    tail: Tensor  # the reduced tail, still on the device
    tag: CallTag
    world_size: int
    training: bool


@dataclass
class _InFlight:
    calls: list[_Pending]
    host: Tensor
    event: object  # torch.cuda.Event or a backend's equivalent


class _Monitor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._in_flight: list[_InFlight] = []

    def defer(self, pending: _Pending) -> None:
        """Keep a call's reduced tail for a later check; poll the checks already under way."""
        with self._lock:
            self._pending.append(pending)
            if len(self._pending) >= _COPY_EVERY:
                self._launch()
            ready = [job for job in self._in_flight if job.event.query()]
            self._in_flight = [job for job in self._in_flight if job not in ready]
        for job in ready:
            _raise_first(job)

    def check(self) -> None:
        """Wait for every deferred check and raise the first error among them."""
        with self._lock:
            if self._pending:
                self._launch()
            jobs, self._in_flight = self._in_flight, []
        for job in jobs:
            job.event.synchronize()
            _raise_first(job)

    def _launch(self) -> None:
        calls, self._pending = self._pending, []
        tails = torch.stack([call.tail for call in calls])
        host = torch.empty(tails.shape, dtype=tails.dtype, pin_memory=True)
        host.copy_(tails, non_blocking=True)
        event = torch.cuda.Event() if tails.is_cuda else torch.Event(device=tails.device)
        event.record()
        self._in_flight.append(_InFlight(calls, host, event))


def _raise_first(job: _InFlight) -> None:
    for call, tail in zip(job.calls, job.host.tolist(), strict=True):
        result = _moments.verdict(tail, call.world_size)
        _moments.raise_for(result, call.tag, call.world_size, None, call.training)


_monitor = _Monitor()


def defer(tail: Tensor, tag: CallTag, world_size: int, training: bool) -> None:
    """Check a call's reduced ``tail`` later (a rank whose own input was rejected has raised already)."""
    _monitor.defer(_Pending(tail, tag, world_size, training))


def check_sync() -> None:
    """Raise any error of synchronized calls whose checks are still deferred; wait for them to finish.

    On the CPU every synchronized call checks its reduced values at once. On GPUs the checks of a call
    (ranks out of step, an input rejected on some rank, a single value per channel) run on the device and
    are read back without stalling: an error is raised by a later synchronized call, at the latest here.
    Call it once per training step (after ``optimizer.step()``, for example) to bound how far a bad step
    can go unnoticed; every rank raises the same error.
    """
    _monitor.check()
