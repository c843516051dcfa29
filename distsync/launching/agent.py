"""The agent side of :func:`distsync.launch`: ranks that end without a result, and why each rank ended.

torch's elastic agent waits for a result from every function worker: one that exits with code 0 without
returning (``sys.exit()``, ``os._exit(0)``) leaves it, and every rank that did return, waiting forever.
:func:`ranks_ending_watched` makes the agent notice such a rank: once every worker has either returned or
ended, the world is done, and the ranks without a result are marked :class:`NoResult`. When a worker
fails, the ranks that had already ended without a result are reported with it.

:func:`keep_alive_stopped_on_signal` stops the rendezvous keep-alive thread of an agent stopped by a
signal, so that the process exits with the signal's code rather than aborting inside torch's store client.

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
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed.elastic.multiprocessing as elastic_mp
import torch.distributed.elastic.rendezvous.registry as rendezvous_registry
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, RunProcsResult, SignalException
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


# How long a stopped agent waits for its rendezvous keep-alive call in flight (a store that answers takes
# milliseconds; one whose server is gone fails at once).
KEEP_ALIVE_STOP_S = 10.0


def stop_keep_alive(handler: Any, timeout: float = KEEP_ALIVE_STOP_S) -> bool:
    """Stop the keep-alive thread of torch's dynamic rendezvous ``handler`` (c10d, etcd-v2) without closing
    the rendezvous; wait up to ``timeout`` s for the call it has in flight. Returns whether no keep-alive
    thread is left (True for a handler without one: static, distsync's local one).

    The timer is the handler's private ``_keep_alive_timer`` (torch 1.9 to 2.14 at least); its public
    ``cancel`` sets its stop event and joins its thread without a bound, so it runs in a thread of its
    own here."""
    timer = getattr(handler, "_keep_alive_timer", None)
    cancel = getattr(timer, "cancel", None)
    if cancel is None:
        return True
    stopper = threading.Thread(target=cancel, name="distsync-stop-keep-alive", daemon=True)
    stopper.start()
    stopper.join(timeout)
    return not stopper.is_alive()


@contextlib.contextmanager
def keep_alive_stopped_on_signal() -> Iterator[None]:
    """Within this block, the rendezvous handlers torch's agents create are kept; when a signal stops the
    agent (``SignalException``), their keep-alive threads are stopped before the exception goes on.

    On a signal torch's ``launch_agent`` leaves the rendezvous open (so that the other nodes may go on),
    and with it the handler's keep-alive: a daemon thread that calls the rendezvous store every few
    seconds. When the node that served the store has just exited, that call fails; if it returns while
    this process's interpreter is finalizing, the thread is torn down inside the store's C++ client and
    the process aborts ("terminate called without an active exception", exit 134 instead of 143, so a
    SLURM script that requeues on 143 does not)."""
    handlers: list[Any] = []
    create = rendezvous_registry.get_rendezvous_handler

    def kept(*args: Any, **kwargs: Any) -> Any:
        handler = create(*args, **kwargs)
        handlers.append(handler)
        return handler

    rendezvous_registry.get_rendezvous_handler = kept
    try:
        yield
    except Exception as error:
        if signal_behind(error) is not None:
            for handler in handlers:
                stop_keep_alive(handler)
        raise
    finally:
        rendezvous_registry.get_rendezvous_handler = create


def signal_behind(error: BaseException) -> SignalException | None:
    """The ``SignalException`` that ``error`` is, or was raised while handling (torch's cleanup can fail
    on its way out: its metrics wrapper raises ``UnboundLocalError`` when the signal lands before the
    wrapper has read the clock), else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, SignalException):
            return error
        seen.add(id(error))
        error = error.__context__
    return None
