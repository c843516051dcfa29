"""Processes a test leaves running: found after it, killed, and named.

A process that outlives its test (a rank whose test gave up on it, a loader worker whose rank was killed, a
worker that a launcher lost) keeps its CPU, memory and ports for the rest of the run: on a two-core CI machine
every later test that starts processes then runs slower and fails on its timeout, and the run says nothing
of why. The test process is made a child subreaper (Linux), so such orphans become its children instead of
init's and stay findable; after each test, whatever it started that is still running is killed and named.

Only Linux has the subreaper and ``/proc``: elsewhere nothing is looked for.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36
# Helpers that live as long as the test process by design. multiprocessing's forkserver and resource tracker,
# children of the test process: the forkserver's own children are the ranks of run_world's worlds, and are
# looked at. Inductor's pool of compile workers, with the workers it forks (its module path on older torch).
_OWN_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
_POOLS = ("torch._inductor.compile_worker", "torch/_inductor/compile_worker/")
_GRACE_S = 5.0  # a process told to stop as its test ended gets this long to go by itself


def watch() -> bool:
    """Make this process a subreaper; False where there is no ``/proc`` or ``prctl`` to do it with."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[1]), fields[0]


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie waiting for its parent (or a non-reaping init) to collect it."""
    stat = _stat(pid)
    return stat is not None and stat[1] not in ("Z", "X")


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def running_descendants(root: int | None = None) -> dict[int, int]:
    """The processes below ``root`` (this one by default) that have not ended, each with its parent; zombies
    among this process's own children are reaped on the way (an orphan that ended after it was reparented
    here has no one else to reap it)."""
    root = os.getpid() if root is None else root
    parents: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents.setdefault(stat[0], []).append(int(entry.name))
            states[int(entry.name)] = stat[1]
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for child in parents.get(parent, ()):
            if states[child] != "Z":
                found[child] = parent
                todo.append(child)
            elif root == os.getpid():
                _reap(child)
    return found


def running_in_group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that still run (zombies left to this subreaper do not)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            state, _, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError, IndexError):
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not ours (a grandchild), or already reaped by its Popen
        pass


def _long_lived(pid: int, parent: int) -> bool:
    line = command(pid)
    if any(name in line for name in _POOLS):
        return True
    return parent == os.getpid() and any(name in line for name in _OWN_HELPERS)


def kill_new(before: dict[int, int]) -> dict[int, str]:
    """Kill what runs below this process now and did not before (but the long-lived helpers); return the
    command line of each process that had to be killed."""
    deadline = time.monotonic() + _GRACE_S
    while True:
        now = running_descendants()
        new = {pid for pid, parent in now.items() if pid not in before and not _long_lived(pid, parent)}
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    leaked = {pid: command(pid) for pid in sorted(new)}
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.1)
    running_descendants()  # reaps those that were this process's children
    return leaked
