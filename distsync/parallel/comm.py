"""Master/slave message passing between the replicas of one process: pure threading, no torch.

The protocol of Synchronized-BatchNorm and jactorch: during replication every slave copy registers with the
master copy's :class:`SyncMaster` and gets a :class:`SlavePipe`; during forward the master collects one
message per slave, a callback turns them into one reply per copy, and every copy continues with its reply.

Unlike the originals, every wait is bounded and failures are shared: when the master callback raises, a
slave does not arrive in time, or :meth:`SyncMaster.abort` is called, every copy that is (or later gets)
blocked on this master raises :class:`~distsync.SyncError` instead of hanging.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from distsync.errors import SyncError

__all__ = ["FutureResult", "SlavePipe", "SyncMaster"]

_EMPTY = object()


class _Abort(NamedTuple):
    """Queue item that wakes a master blocked on collection because the round has failed."""

    error: BaseException


class FutureResult:
    """A one-slot mailbox a slave waits on: the master puts one reply (or an error) per round.

    Args:
        timeout: seconds ``get`` waits for the master to take this slave's message, or ``None`` to wait
            forever. Once the master has the message, the wait is bounded by the master's own collection
            timeout instead, so a slow master callback (a cross-process all-reduce) is not cut short.
            Default: ``None``
    """

    def __init__(self, timeout: float | None = None) -> None:
        self._cond = threading.Condition()
        self._timeout = timeout
        self._result: Any = _EMPTY
        self._error: BaseException | None = None
        self._accepted = False

    def put(self, result: Any) -> None:
        with self._cond:
            self._result = result
            self._cond.notify_all()

    def put_error(self, error: BaseException) -> None:
        """Fail this and every later ``get`` (until a new registration replaces this mailbox)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def accept(self) -> BaseException | None:
        """The master has taken the message of the current round; returns the error if the slave gave up."""
        with self._cond:
            self._accepted = True
            self._cond.notify_all()
            return self._error

    def get(self) -> Any:
        with self._cond:
            deadline = None if self._timeout is None else time.monotonic() + self._timeout
            while self._result is _EMPTY and self._error is None:
                if deadline is None or self._accepted:
                    self._cond.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._error = SyncError(
                        f"the master copy did not take this copy's message within {self._timeout:g} s "
                        "(did the master replica fail, or call the layer fewer times?)"
                    )
                    break
                self._cond.wait(remaining)
            if self._error is not None:
                raise SyncError(f"replica synchronization failed: {self._error}") from self._error
            result, self._result, self._accepted = self._result, _EMPTY, False
            return result


class _SlavePipeBase(NamedTuple):
    identifier: Hashable
    queue: queue.Queue
    result: FutureResult


class SlavePipe(_SlavePipeBase):
    """Pipe for master-slave communication: a slave copy's end, from :meth:`SyncMaster.register_slave`."""

    def run_slave(self, msg: Any) -> Any:
        """Send ``msg`` to the master and return the master callback's reply to this slave."""
        self.queue.put((self.identifier, msg))
        try:
            return self.result.get()
        except SyncError as error:
            self.queue.put(_Abort(error))  # wake a master still collecting, so it fails too
            raise


class SyncMaster:
    """The master copy's end of the replicas' rendezvous.

    - During replication, every slave copy calls :meth:`register_slave` and keeps the :class:`SlavePipe`.
    - During forward, the master copy calls :meth:`run_master`: it collects one message from every slave,
      calls ``master_callback([(0, master_msg), (identifier, msg), ...])``, which must return
      ``[(0, master_reply), (identifier, reply), ...]`` (the master's first), sends each slave its reply
      and returns the master's.

    Registering a slave after a round has run starts a new replication: the registry is cleared. The object
    pickles (only the callback and the timeout are kept), so a module holding one can be ``torch.save``-d.

    Args:
        master_callback: turns the round's messages into the round's replies; runs in the master's thread
        timeout: seconds the master waits for the slaves' messages, and slaves for the master to take
            theirs, before the round fails on every copy; ``None`` waits forever. Default: ``None``

    Examples::

        >>> master = SyncMaster(lambda msgs: [(i, sum(m for _, m in msgs)) for i, _ in msgs])
        >>> pipe = master.register_slave(1)
        >>> # thread of copy 1: pipe.run_slave(2) -> 3; thread of copy 0: master.run_master(1) -> 3
    """

    def __init__(
        self, master_callback: Callable[[list[tuple[Any, Any]]], list[tuple[Any, Any]]], timeout=None
    ) -> None:
        self._master_callback = master_callback
        self._timeout = timeout
        self._queue: queue.Queue = queue.Queue()
        self._registry: collections.OrderedDict[Hashable, FutureResult] = collections.OrderedDict()
        self._activated = False
        self._error: BaseException | None = None

    def __getstate__(self) -> dict:
        return {"master_callback": self._master_callback, "timeout": self._timeout}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["master_callback"], state.get("timeout"))

    def register_slave(self, identifier: Hashable) -> SlavePipe:
        """Register a slave copy (``identifier`` is usually its copy id; 0 is the master's).

        Returns:
            the :class:`SlavePipe` the slave communicates through.
        """
        if identifier == 0:
            raise ValueError("identifier 0 is the master's; slaves are usually numbered from 1")
        if self._activated:  # a new replication: forget the previous copies and anything they left behind
            self._activated = False
            self._error = None
            self._registry.clear()
            while not self._queue.empty():
                self._queue.get_nowait()
        future = FutureResult(self._timeout)
        self._registry[identifier] = future
        return SlavePipe(identifier, self._queue, future)

    @property
    def nr_slaves(self) -> int:
        """The number of registered slave copies."""
        return len(self._registry)

    def run_master(self, master_msg: Any) -> Any:
        """Collect every slave's message, run the callback, deliver the replies; return the master's reply."""
        self._activated = True
        if self._error is not None:
            raise SyncError(f"replica synchronization failed: {self._error}") from self._error
        intermediates = [(0, master_msg)]
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        for _ in range(self.nr_slaves):
            self._collect(intermediates, deadline)
        try:
            results = list(self._master_callback(intermediates))
            if not results or results[0][0] != 0:
                raise ValueError("the master callback must return the master's reply (identifier 0) first")
            replies = dict(results[1:])
            missing = [identifier for identifier in self._registry if identifier not in replies]
            if missing:
                raise ValueError(f"the master callback returned no reply for slaves {missing}")
        except BaseException as error:
            self._fail(error)
            raise
        for identifier, future in self._registry.items():
            future.put(replies[identifier])
        return results[0][1]

    def _collect(self, intermediates: list, deadline: float | None) -> None:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            item = self._queue.get(timeout=remaining)
        except queue.Empty:
            arrived = {identifier for identifier, _ in intermediates}
            late = [identifier for identifier in self._registry if identifier not in arrived]
            error = SyncError(
                f"slave copies {late} did not arrive within {self._timeout:g} s (did a replica fail, or "
                "call the layer a different number of times?)"
            )
            self._fail(error)
            raise error from None
        if isinstance(item, _Abort):
            self._fail(item.error)
            raise SyncError(f"replica synchronization failed: {item.error}") from item.error
        identifier, msg = item
        if identifier not in self._registry or any(identifier == seen for seen, _ in intermediates):
            error = SyncError(f"unexpected message from slave {identifier!r} in this round")
            self._fail(error)
            raise error
        gave_up = self._registry[identifier].accept()
        if gave_up is not None:  # the slave timed out waiting for this master: the round is lost
            self._fail(gave_up)
            raise SyncError(f"replica synchronization failed: {gave_up}") from gave_up
        intermediates.append((identifier, msg))

    def abort(self, error: BaseException) -> None:
        """Fail the current and later rounds on every copy: call it when one copy cannot continue."""
        self._fail(error)
        self._queue.put(_Abort(error))

    def _fail(self, error: BaseException) -> None:
        self._activated = True
        if self._error is None:
            self._error = error
        for future in list(self._registry.values()):
            future.put_error(error)
