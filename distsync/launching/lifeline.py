"""Workers die with the elastic agent that started them.

When the agent (``distsync.launch``'s process, ``python launch/train.py``, or ``torchrun``) is SIGKILLed it
cannot stop its workers; left alone they keep training into the run directory, or hang in a collective or
in gloo's teardown for minutes. :func:`die_with_parent` makes the kernel SIGKILL the worker when its parent
exits (``prctl(PR_SET_PDEATHSIG)`` on Linux) and starts a daemon thread that SIGKILLs the worker once the
agent is gone. SIGKILL, not SIGTERM: a process stuck inside a C++ collective never runs a Python signal
handler, and everything a worker must not lose is already on disk atomically.

Who the agent is depends on how the worker was started. A ``multiprocessing`` worker knows the process
that created it (:func:`multiprocessing.parent_process`) whatever the start method, and holds the end of a
pipe that the kernel closes when that process dies: under ``forkserver`` the worker's OS parent is the fork
server, not the agent, so the parent pid alone would name the wrong process. Any other worker (``torchrun``
runs its workers as plain subprocesses) is watched through its parent pid. The processes that a rank's own
fork server forks (its DataLoader workers) arm it as well, toward the rank (:mod:`.rank_fork_server`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1
_armed = False


def die_with_parent(poll_interval: float = 1.0) -> None:
    """Arrange for this process to be SIGKILLed as soon as the process that started it exits; idempotent.

    Call it first thing in a worker. ``PR_SET_PDEATHSIG`` fires when the parent *thread* that forked this
    process exits (under ``forkserver``: when the fork server exits, which it does only once the process that
    started it and every process it forked are gone); the watchdog thread covers every case, on every
    platform: a ``multiprocessing`` worker wakes up as soon as the agent's end of its pipe closes, any other
    process checks its parent pid every ``poll_interval`` seconds.

    Args:
        poll_interval: seconds between the watchdog's checks of the parent pid, for workers that
            ``multiprocessing`` did not start. Default: 1.0
    """
    global _armed
    if _armed:
        return
    _armed = True
    parent_alive, watch = _agent_watch(poll_interval)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no usable libc: the watchdog alone
            pass
    if not parent_alive():  # the agent died before prctl took effect
        _die()
    threading.Thread(target=watch, name="distsync-parent-watchdog", daemon=True).start()


def _agent_watch(poll_interval: float) -> tuple[Callable[[], bool], Callable[[], None]]:
    """``(is the agent alive?, block until it is not, then die)`` for this process."""
    spawner = multiprocessing.parent_process()
    if spawner is not None and _has_sentinel(spawner):
        # The agent holds the other end of the pipe whose read end is the sentinel: it reads EOF (is
        # "ready") once the agent has exited, even if the agent died while this process was starting.
        def watch_pipe() -> None:
            spawner.join()
            _die()

        return spawner.is_alive, watch_pipe

    parent = os.getppid()

    def watch_pid() -> None:
        while os.getppid() == parent:
            time.sleep(poll_interval)
        _die()

    return lambda: os.getppid() == parent, watch_pid


def _has_sentinel(process: multiprocessing.process.BaseProcess) -> bool:
    try:
        return process.sentinel is not None
    except ValueError:  # "process not started": no pipe to watch
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
