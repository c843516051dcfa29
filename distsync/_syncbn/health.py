"""Deferred desync and bad-input checks for synchronized calls off the CPU.

Reading a reduced payload on the host would stall a GPU's queue once per layer and direction. Off the CPU
(and under ``torch.compile``), each call instead leaves its reduced tail here. The schedule depends on call
counts only, never on how far a device has got, so every rank that makes the same calls raises at the same
call: every ``_LAG`` deferred calls, the tails queued since the last time are copied without blocking to the
host, on the stream that produced them (one copy per device and stream, behind an event recorded there), and
the copies started ``_LAG`` calls earlier are waited for and read. A call's error is thus raised between
``_LAG`` and ``2 * _LAG - 1`` deferred calls later, at the latest by :func:`check_sync`. The tails are
identical on every rank, so every rank raises the same error.

A wait that outlasts half the process group's timeout means a peer left the collectives (it raised, died or
is out of step): it raises :class:`SyncError` naming the calls waited for, before NCCL's watchdog (which
acts at the full timeout) takes the process down.

While a CUDA graph is being captured nothing is queued, copied or waited for (no host work is allowed
then): the tails of captured calls, rewritten by every replay, are read by :func:`check_sync` instead.
Running statistics are protected on the device meanwhile (see ``_payload.running_stat_weight``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from distsync._syncbn import compiled as _compiled
from distsync._syncbn import payload as _payload
from distsync._syncbn.payload import CallTag
from distsync.errors import SyncError

__all__ = ["check_sync"]

_LAG = 8  # deferred calls between a call and the wait for its verdict
_DEFAULT_TIMEOUT = 600.0  # seconds, when the transport does not say (DataParallel replicas)


@dataclass
class _Pending:
    tail: Tensor  # the reduced tail, still on the device
    tag: CallTag
    world_size: int
    training: bool
    timeout: float  # the process group's timeout, in seconds


@dataclass
class _InFlight:
    calls: list[_Pending]
    host: Tensor
    event: object | None  # recorded on the producing stream after the copy; None for a synchronous copy


class DeviceRuntime:
    """The few runtime calls the monitor makes, through the module's ``runtime``, which tests replace where no
    GPU driver is (``distsync.testing.cuda_trace.fake_runtime``)."""

    @staticmethod
    def capturing(device: torch.device) -> bool:
        # torch's SyncBatchNorm guards its host-side work with the same query.
        return device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    @staticmethod
    def current_stream(device: torch.device):
        if device.type == "cpu":
            return None
        if device.type == "cuda":
            return torch.cuda.current_stream(device)
        return torch.accelerator.current_stream(device)

    @staticmethod
    def on(stream):
        """Make ``stream`` (and its device) current: work issued inside is ordered after the tails."""
        if stream is None:
            return contextlib.nullcontext()
        if isinstance(stream, torch.cuda.Stream):
            return torch.cuda.stream(stream)
        return stream

    @staticmethod
    def host_buffer(like: Tensor) -> Tensor:
        # Pinned, so that the device-to-host copy does not block the host (CUDA only).
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)

    @staticmethod
    def record(stream):
        return None if stream is None else stream.record_event()


runtime = DeviceRuntime()


class _Monitor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0  # deferred calls so far: the same on every rank that is in step
        self._queues: dict[tuple, list[_Pending]] = {}  # by (device, stream)
        self._in_flight: list[_InFlight] = []  # copies launched at the last multiple of _LAG
        self._captured: list[_Pending] = []  # calls inside CUDA graphs: their tails change at each replay

    def defer(self, pending: _Pending) -> None:
        """Queue a call's reduced tail; every ``_LAG`` calls, copy the queued ones and read the previous."""
        device = pending.tail.device
        if runtime.capturing(device):
            with self._lock:
                self._captured.append(pending)
            return
        stream = runtime.current_stream(device)
        with self._lock:
            self._queues.setdefault((device, stream), []).append(pending)
            self._calls += 1
            if self._calls % _LAG:
                return
            due, self._in_flight = self._in_flight, self._launch()
        _read(due)

    def check(self) -> None:
        """Wait for every deferred check and raise the first error among them (and of captured calls)."""
        with self._lock:
            jobs = self._in_flight + self._launch()
            self._in_flight = []
            captured = list(self._captured)
        _read(jobs)
        for device in {call.tail.device for call in captured}:
            calls = [call for call in captured if call.tail.device == device]
            _raise_first(_InFlight(calls, torch.stack([call.tail for call in calls]).cpu(), None))

    def _launch(self) -> list[_InFlight]:
        jobs = []
        for (_, stream), calls in self._queues.items():
            with runtime.on(stream):  # ordered after the all-reduces that produced the tails
                tails = torch.stack([call.tail for call in calls])
                host = runtime.host_buffer(tails)
                host.copy_(tails, non_blocking=tails.is_cuda)
                jobs.append(_InFlight(calls, host, runtime.record(stream)))
        self._queues = {}
        return jobs


def _read(jobs: list[_InFlight]) -> None:
    for job in jobs:
        _wait(job)
    for job in jobs:
        _raise_first(job)


def _wait(job: _InFlight) -> None:
    """Wait for ``job``'s copy; a peer that left the collectives would keep it from ever landing."""
    if job.event is None or job.event.query():
        return
    timeout = min(call.timeout for call in job.calls) / 2
    deadline = time.monotonic() + timeout
    while not job.event.query():
        if time.monotonic() > deadline:
            first, last = job.calls[0].tag.describe(), job.calls[-1].tag.describe()
            raise SyncError(
                f"the synchronized calls from {first} to {last} "
                f"did not complete within {timeout:.0f} s (half the process group's timeout): a peer raised, "
                "exited or is out of step"
            )
        time.sleep(0.001)


def _raise_first(job: _InFlight) -> None:
    for call, tail in zip(job.calls, job.host.tolist(), strict=True):
        result = _payload.verdict(tail, call.world_size)
        _payload.raise_for(result, call.tag, call.world_size, None, call.training)


_monitor = _Monitor()


def defer(tail: Tensor, tag: CallTag, world_size: int, training: bool, timeout: float | None = None) -> None:
    """Check a call's reduced ``tail`` later (a rank whose own input was rejected has raised already)."""
    _monitor.defer(_Pending(tail, tag, world_size, training, timeout or _DEFAULT_TIMEOUT))


def check_sync() -> None:
    """Raise any error of synchronized calls whose checks are still deferred; wait for them to finish.

    On the CPU every synchronized call checks its reduced values at once. On GPUs (and in code compiled
    with ``torch.compile``) the checks of a call (ranks out of step, an input rejected on some rank, a single
    value per channel) run on the device and are read back without stalling: an error is raised
    ``8`` to ``15`` synchronized calls later, at the same call on every rank, and at the latest here.
    Call it once per training step (after ``optimizer.step()``, for example) to bound how far a bad step
    can go unnoticed; every rank raises the same error. Calls captured in a CUDA graph are checked here
    as of the latest replay (call it after replaying).
    """
    _monitor.check()
    _compiled.check()
