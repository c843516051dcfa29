"""What a rank's own fork server imports first: every process it forks dies with the process that asked.

A rank of :func:`distsync.launch` is a ``forkserver`` process (the default ``start_method``), so
``multiprocessing`` defaults to ``forkserver`` in it as well (CPython's: a child keeps its parent's start
method; Python 3.14 makes it the default everywhere on Linux). The rank's DataLoader workers, its pools and
processes are then forked by a fork server of the rank's own, not by the rank. When the rank is SIGKILLed
(the OOM killer, a dead launcher's lifeline), nothing ends them:

- torch's DataLoader worker watches its OS parent (``ManagerWatchdog``: ``os.getppid()``), which is the
  fork server, not the rank;
- the fork server ends only once every holder of its lifeline pipe is gone (``multiprocessing`` hands
  the write end to every child it forks), and its children hold it.

Each keeps the other running, for good. :func:`~distsync.launching.worker.run_rank` therefore adds this
module to the rank's forkserver preload (``multiprocessing.set_forkserver_preload``): imported in the
rank's fork server, it registers an after-fork hook that runs in every child, before the child's target,
and arms :func:`~distsync.launching.lifeline.die_with_parent` there. That child's ``multiprocessing`` parent
is the rank (a pipe the kernel closes when the rank dies), so it SIGKILLs itself as soon as the rank is
gone, and the fork server, its last child gone, ends on its own. Its ``PR_SET_PDEATHSIG`` points at the fork
server's one thread, which forks every child and lives as long as they do. The fork server itself is left
as ``multiprocessing`` runs it: no thread (it forks), no parent-death signal (it is started from whichever
of the rank's threads first needs it, which may end long before the rank).

Nothing else imports this module: in another process its hook would arm the lifeline in that process's
``multiprocessing`` children, which is that process's business. A rank that sets a preload list of its own
replaces this one; adding ``"distsync.launching.rank_fork_server"`` to it keeps the lifeline.
"""

from __future__ import annotations

from multiprocessing import util

from distsync.launching.lifeline import die_with_parent

__all__: list[str] = []


class _Arm:
    """The after-fork hook (``multiprocessing`` keeps it in a weak registry: this module holds it)."""

    def __call__(self) -> None:
        die_with_parent()


_hook = _Arm()
util.register_after_fork(_hook, _Arm.__call__)
