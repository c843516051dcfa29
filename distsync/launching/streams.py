"""A worker forked by a fork server writes where its launching process writes, in that process's group.

A worker that ``spawn`` or ``fork`` starts inherits its launching process's standard streams and process
group. One that a fork server forks inherits the server's: those of the process that started the server,
as they were then. A packed job's workers, forked from the launcher's server (``launching.packing``),
would print outside the job's tagged pipes and get a terminal's Ctrl-C behind their agent's back.
:class:`LaunchingStreams` travels to each worker in its start-up arguments and puts the launching
process's stdout, stderr and group back in place there.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

__all__ = ["LaunchingStreams"]

_STANDARD_FDS = (1, 2)


class LaunchingStreams:
    """The launching process's stdout, stderr and process group, for its workers.

    Pickled while a fork server starts a worker, it carries duplicates of the launching process's fds 1 and
    2, which ``multiprocessing`` hands the new process as it hands a ``Connection``'s, and puts them in
    place as it is unpickled there: before the rest of the worker's arguments, so that even a worker whose
    agent is gone before it starts (its queue's semaphore with it) writes its error where the agent wrote.
    Pickled otherwise, it carries the group alone (a spawned or forked worker has the streams already).
    """

    def __init__(self, fds: tuple[Any, ...] | None = None, pgid: int | None = None) -> None:
        self.fds = fds
        self.pgid = os.getpgrp() if pgid is None else pgid

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import context, reduction

        popen = context.get_spawning_popen()
        if popen is None or type(popen).__module__ != "multiprocessing.popen_forkserver":
            return LaunchingStreams, (None, self.pgid)
        return _adopted, (tuple(reduction.DupFd(fd) for fd in _STANDARD_FDS), self.pgid)

    def adopt(self) -> None:
        """In a worker a fork server forked: fds 1 and 2 are the launching process's, and so is the group."""
        if self.fds is None:
            return
        for wrapper, standard in zip(self.fds, _STANDARD_FDS, strict=True):
            fd = wrapper.detach()
            if fd != standard:
                os.dup2(fd, standard)
                os.close(fd)
        self.fds = None
        with contextlib.suppress(OSError):  # another session's group: stay in the server's
            os.setpgid(0, self.pgid)


def _adopted(fds: tuple[Any, ...], pgid: int) -> LaunchingStreams:
    """Unpickled in a worker that a fork server forked: the launching process's streams and group, now."""
    streams = LaunchingStreams(fds, pgid)
    streams.adopt()
    return streams
