"""What the fork server of :func:`distsync.launch` imports first: its children take SIGTERM again.

A scheduler's SIGTERM reaches every process of the job (``scancel``, preemption, ``scontrol requeue``, ``kill
-TERM -<process group>``). ``multiprocessing``'s fork server has no handler for it: it would die first, and
with it every worker (their parent-death signal; the agent reads exit code 255 for each) before the workers
save their steps at the next logging step. So :func:`~distsync.launching.elastic.start_fork_server` starts the
server with SIGTERM blocked, which leaves it to end, as always, with the process that started it (its lifeline
pipe). Importing this module in the server (a preload) keeps it blocked there and makes every process forked
from it unblock SIGTERM before it runs anything: the workers stop on SIGTERM as they would anywhere else.

It also imports, in the server, the libraries the launching process had imported and their modules one level
down (named in ``$DISTSYNC_FORK_SERVER_IMPORTS``, which it takes out of its environment): each worker then
starts with them imported. ``multiprocessing``'s own preload lets only an ``ImportError`` pass, so a library
that raises anything else in a fresh interpreter (one the launching process made importable in its own way,
one that needs a variable only that process had) would kill the server, and every worker start would fail
with an ``EOFError``. Here such a library is left out: a worker that needs it imports it itself and reports
that import's error as its own. What the imports warn of is not said again (the launching process said it).

Nothing else imports this module: in another process it would unblock SIGTERM in that process's
``multiprocessing`` children, which is that process's business.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import warnings
from multiprocessing import util

__all__: list[str] = []

_IMPORTS_ENV = "DISTSYNC_FORK_SERVER_IMPORTS"  # comma-separated module names, set by start_fork_server


class _Unblock:
    """The after-fork hook (``multiprocessing`` keeps it in a weak registry: this module holds it)."""

    def __call__(self) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the server: as it was started, and stays
_hook = _Unblock()
util.register_after_fork(_hook, _Unblock.__call__)

with warnings.catch_warnings():  # what importing them warns of, the launching process has said already
    warnings.simplefilter("ignore")
    for _name in filter(None, os.environ.pop(_IMPORTS_ENV, "").split(",")):
        with contextlib.suppress(Exception):  # left to the workers that need it (see above)
            importlib.import_module(_name)
