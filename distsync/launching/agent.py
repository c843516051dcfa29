"""The agent side of :func:`distsync.launch`: ranks that end without a result, and why each rank ended.

torch's elastic agent waits for a result from every function worker: one that exits with code 0 without
returning (``sys.exit()``, ``os._exit(0)``) leaves it, and every rank that did return, waiting forever.
:func:`ranks_ending_watched` makes the agent notice such a rank: once every worker has either returned or
ended, the world is done, and the ranks without a result are marked :class:`NoResult`. When a worker
fails, the ranks that had already ended without a result are reported with it.

This extends torch's ``MultiprocessContext`` through its private members (``_poll``, ``_close``, ``_pc``,
``_return_values``, ``error_files``, ``nprocs``, 2.3 to 2.14 at least). Where a release lacks one of them,
the agent runs torch's own context unchanged (a rank ending without a result then leaves the others
waiting, as torch does), never a broken one; ``tests/test_private_apis.py`` names each member, so such a
release fails there in CI first.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed.elastic.multiprocessing as elastic_mp
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, RunProcsResult
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


@dataclass(frozen=True)
class NoResult:
    """What the agent got from a rank that ended with exit code 0 without returning."""

    exit_code: int
    reported: str  # why, as the rank told it (``sys.exit()``), or "" (``os._exit(0)`` says nothing)


class WorldNotRestarted(Exception):
    """Raised out of the agent when a rank failed with :class:`~distsync.NonRetryableError`: the
    agent stops its workers and gives up at once, whatever restarts were left."""

    def __init__(self, message: str, failures: dict[int, tuple[int, str]]) -> None:
        super().__init__(message)
        self.message, self.failures = message, failures


def _not_to_be_retried(failure: ProcessFailure) -> tuple[int, str] | None:
    """``(global rank, message)`` if the rank asked not to be restarted, else None."""
    if not os.path.isfile(failure.error_file) or not isinstance(failure.message, dict):
        return None
    info = failure.message.get("extraInfo") or {}
    if info.get("retry", True):
        return None
    return int(info.get("rank", failure.local_rank)), str(failure.message.get("message", ""))


def reported(failure: ProcessFailure) -> str:
    """Why the rank ended as the rank itself wrote it into its error file, or "" without one."""
    if not os.path.isfile(failure.error_file):
        return ""
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "")


def describe(exit_code: int, why: str) -> str:
    """One line: why a rank ended, and how: ``sys.exit('no data') (exit code 1)``, ``killed by SIGKILL``."""
    if exit_code < 0:
        try:
            how = f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            how = f"killed by signal {-exit_code}"
    else:
        how = f"exit code {exit_code}"
    lines = why.strip().splitlines()
    return f"{lines[0]} ({how})" if lines else how


# The private members of torch's context this module relies on: methods of the class, attributes of instances.
PRIVATE_METHODS = ("_poll", "_close")
PRIVATE_ATTRIBUTES = ("_pc", "_return_values", "error_files", "nprocs")


def torch_supports_watching() -> bool:
    """Whether this torch's ``MultiprocessContext`` has the private methods the watching context overrides,
    with the signatures it calls them with."""
    methods = [getattr(MultiprocessContext, name, None) for name in PRIVATE_METHODS]
    if not all(callable(method) for method in methods):
        return False
    parameters = list(inspect.signature(MultiprocessContext._close).parameters)
    return parameters[:3] == ["self", "death_sig", "timeout"]


class _ResultAwareContext(MultiprocessContext):
    """torch's context of function workers, which also notices the workers that end without a result."""

    _final = False  # a rank raised NonRetryableError: the workers are being stopped for good

    def _poll(self) -> RunProcsResult | None:
        if not all(hasattr(self, name) for name in PRIVATE_ATTRIBUTES):
            return super()._poll()  # a release whose context keeps its state elsewhere: torch's behaviour
        self._raise_if_not_to_be_restarted()  # before torch logs the failure as one to restart for
        result = super()._poll()
        if result is not None:
            if result.is_failed():  # the failed rank, and those that had ended without a result before it
                result.failures = {**self._ended_without_result(), **result.failures}
            return result
        ended = self._ended_without_result()
        if not ended or len(self._return_values) + len(ended) < self.nprocs:
            return None  # some worker is still running: it may yet return
        for local_rank, failure in ended.items():
            self._return_values[local_rank] = NoResult(failure.exitcode, reported(failure))
        return super()._poll()  # every rank accounted for: torch releases the workers and collects them

    def _raise_if_not_to_be_restarted(self) -> None:
        assert self._pc is not None
        failed = [
            ProcessFailure(local_rank, process.pid, process.exitcode, self.error_files[local_rank])
            for local_rank, process in enumerate(self._pc.processes)
            if process.exitcode not in (None, 0)
        ]
        final = [f for f in map(_not_to_be_retried, failed) if f is not None]
        if final:
            self._final = True
            raise WorldNotRestarted(final[0][1], {rank: (1, message) for rank, message in final})

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        if not self._final:
            return super()._close(death_sig, timeout)
        torch_log = logging.getLogger(MultiprocessContext.__module__)
        torch_log.disabled = True  # "Closing process ... via signal SIGTERM", for each peer: known
        try:
            super()._close(death_sig, timeout)
        finally:
            torch_log.disabled = False

    def _ended_without_result(self) -> dict[int, ProcessFailure]:
        """Workers that exited with code 0 and put no result in their queue (drained by ``_poll``)."""
        assert self._pc is not None
        return {
            local_rank: ProcessFailure(local_rank, process.pid, 0, self.error_files[local_rank])
            for local_rank, process in enumerate(self._pc.processes)
            if process.exitcode == 0 and local_rank not in self._return_values
        }


# How torch's context logs a failed function worker (its arguments: exit code, local rank, pid, ...): a
# record in another form is left as torch wrote it.
FAILED_WORKER_LOG = "failed (exitcode: %s) local_rank: %s (pid: %s)"


def _one_line_failure(record: logging.LogRecord) -> bool:
    """torch logs its own wait for a failed worker with that wait's traceback: say in one line which local
    rank failed and how (the rank's traceback is on stderr and in its log file, the LaunchError says why)."""
    args = record.args
    if str(record.msg).startswith(FAILED_WORKER_LOG) and isinstance(args, tuple) and len(args) >= 3:
        exit_code, local_rank, pid = args[:3]
        record.msg = "local rank %s (pid %s) failed: %s"
        record.args = (local_rank, pid, describe(exit_code, ""))
        record.exc_info = record.exc_text = None
    return True


@contextlib.contextmanager
def ranks_ending_watched() -> Iterator[None]:
    """Within this block, elastic agents start their function workers in a :class:`_ResultAwareContext`
    (where this torch has what it extends; else in torch's own context)."""
    if not torch_supports_watching():
        yield
        return
    original = elastic_mp.MultiprocessContext
    elastic_mp.MultiprocessContext = _ResultAwareContext
    torch_log = logging.getLogger(MultiprocessContext.__module__)
    torch_log.addFilter(_one_line_failure)
    try:
        yield
    finally:
        elastic_mp.MultiprocessContext = original
        torch_log.removeFilter(_one_line_failure)
