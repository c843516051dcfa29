"""Workers die with the elastic agent that started them.

When the agent (the ``python launch/train.py`` process, or ``torchrun``) is SIGKILLed it cannot stop its
workers; left alone they keep training into the run directory, or hang in a collective or in gloo's
teardown for minutes. :func:`die_with_parent` makes the kernel SIGKILL the worker when its parent exits
(``prctl(PR_SET_PDEATHSIG)`` on Linux) and, as a portable fallback, starts a daemon thread that SIGKILLs
the worker once its parent pid changes. SIGKILL, not SIGTERM: a process stuck inside a C++ collective never
runs a Python signal handler, and everything a worker must not lose is already on disk atomically.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1
_armed = False


def die_with_parent(poll_interval: float = 1.0) -> None:
    """Arrange for this process to be SIGKILLed as soon as its parent process exits; idempotent.

    Call it first thing in a worker. ``PR_SET_PDEATHSIG`` fires when the parent *thread* that forked this
    process exits; the watchdog thread covers that case too, and other platforms, within ``poll_interval``
    seconds.

    Args:
        poll_interval: seconds between the watchdog's checks of the parent pid. Default: 1.0
    """
    global _armed
    if _armed:
        return
    _armed = True
    # A multiprocessing child knows its parent's pid even if the parent died while it was starting up.
    spawner = multiprocessing.parent_process()
    parent = spawner.pid if spawner is not None and spawner.pid else os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no usable libc: the watchdog alone
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(
        target=_watch, args=(parent, poll_interval), name="distsync-parent-watchdog", daemon=True
    ).start()


def _watch(parent: int, poll_interval: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_interval)
    os.kill(os.getpid(), signal.SIGKILL)
