"""``hydra.launcher.n_jobs``: run up to n jobs of a sweep's batch at once, each in a process of its own.

Why processes, not threads: a Hydra job is not thread-safe. ``run_job`` sets the process-global
``HydraConfig`` that :func:`distsync.launch` reads for its workers, may ``chdir`` into the job directory
(``hydra.job.chdir=true``), sets ``hydra.job.env_set`` in ``os.environ`` (which spawned workers inherit),
reconfigures the root logger for the job's ``<job>.log``, and runs the sweep's callbacks (the training job's
sweep summary among them) in the job. So each running job gets a job process, forked from the launcher once
its config is composed here: there ``run_job`` runs exactly as the sequential launcher runs it, and
``distsync.launch`` there is the torchrun agent of the job's world, in that process's main thread, with
torch's own signal handling. Forking costs a few milliseconds and nothing is pickled on the way in; what
comes back is the job's ``JobReturn`` (its value, or the exception that failed it), by pickle, else by
cloudpickle, else as a failure saying why it could not be sent.

Devices: every running job owns one :class:`~distsync.DeviceSet` (a slot); a job that ends hands its slot
to the next one. Jobs start in order and their results come back in job order whatever order they end in.

Ending: a failed job (its task raised, its process died) fails alone and the batch goes on. SIGINT or
SIGTERM to the launcher (Ctrl-C, a scheduler) is passed to every running job, whose agent stops its
workers; no further job starts, and once every job process has ended the launcher exits 128 + the signal
(130, 143), as a single job does. Each job process runs in its own process group (a terminal's Ctrl-C
reaches it once, through the launcher) and is sent SIGTERM when the launcher exits, even SIGKILLed
(``PR_SET_PDEATHSIG``); its workers die with it in turn.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from distsync.launching.device_split import DeviceSet
from distsync.launching.tagged_output import TaggedOutput

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_OUTPUT_GRACE_S = 5.0  # how long the last output of ended jobs is waited for (a stray process holding it)


def job_tag(k: int) -> str:
    return f"[job {k}] "


@dataclass
class Ended:
    """How one job ended: its value, or the exception that failed it, or the code its process exited with
    (a ``SystemExit`` out of the job: the job's own agent stopped by a signal is 128 + the signal)."""

    value: Any = None
    error: BaseException | None = None
    exit_code: int = 0


def run_packed(
    jobs: Sequence[Callable[[DeviceSet], Any]],
    slots: Sequence[DeviceSet],
    started: Callable[[int, DeviceSet], None] = lambda k, slot: None,
    tag: Callable[[int], str] = job_tag,
) -> list[Ended]:
    """Run ``jobs[k](slot)`` each in a forked process, at most ``len(slots)`` at once, each on a slot of
    its own; return how each ended, in job order.

    ``started(k, slot)`` is called in this process as job ``k`` starts; every console line of job ``k``
    (its workers' included) comes out of this process behind ``tag(k)``. Raises ``SystemExit(128 + signal)``
    after SIGINT/SIGTERM stopped the running jobs (none starts after it), and ``SystemExit(code)`` once
    every job ended if a job process exited with a non-zero code of its own (no job starts after it).
    """
    pending = collections.deque(enumerate(jobs))
    ended: list[Ended | None] = [None] * len(jobs)

    def next_job() -> tuple[int, Callable[[DeviceSet], Any]] | None:
        return pending.popleft() if pending else None

    def finished(k: int, how: Ended) -> None:
        ended[k] = how

    run_as_slots_free(next_job, slots, started, finished, tag)
    return ended  # type: ignore[return-value]


def run_as_slots_free(
    next_job: Callable[[], tuple[int, Callable[[DeviceSet], Any]] | None],
    slots: Sequence[DeviceSet],
    started: Callable[[int, DeviceSet], None] = lambda k, slot: None,
    finished: Callable[[int, Ended], None] = lambda k, how: None,
    tag: Callable[[int], str] = job_tag,
) -> None:
    """Whenever a slot is free, ask ``next_job()`` for ``(k, job)`` (None: no more jobs now) and run
    ``job(slot)`` in a forked process on that slot; ``finished(k, how)`` as each job ends, in the order
    they end. So jobs start the moment a slot frees, and what the next job is may depend on how the ones
    before ended (an asynchronous sweep). Returns once no job runs and ``next_job()`` has none; signals,
    exit codes and the jobs' tagged output as :func:`run_packed`. A job that SIGINT or SIGTERM stopped
    (it failed after the signal reached it) is not passed to ``finished``: the ``SystemExit`` raised at
    the end says that every job not reported was interrupted.
    """
    if not slots:
        raise ValueError("run_packed needs at least one slot")
    forking = multiprocessing.get_context("fork")
    free = list(slots)
    running: dict[Connection, tuple[int, multiprocessing.process.BaseProcess, DeviceSet]] = {}
    outputs: dict[int, TaggedOutput] = {}  # by pipe fd, until the pipe's end
    exit_code = 0
    exhausted = False
    with _stop_on_signals(lambda: [proc for _, proc, _ in running.values()]) as stop:
        while True:
            while free and not exhausted and not stop.signum and not exit_code:
                job = next_job()
                if job is None:
                    exhausted = not running  # none now; a job that ends may make more (asked again then)
                    break
                k, fn = job
                slot = free.pop(0)
                reader, writer = forking.Pipe(duplex=False)
                output = TaggedOutput(tag(k))
                proc = forking.Process(target=_job_process, args=(fn, slot, writer, output), name=f"job-{k}")
                started(k, slot)
                proc.start()
                writer.close()
                output.forked()
                outputs.update(dict.fromkeys(output.fds(), output))
                running[reader] = (k, proc, slot)
                stop.reach(proc)  # a signal that came while it was starting
            if not running:
                break
            for reader in wait([*running, *outputs]):
                if isinstance(reader, int):
                    # (a pipe relayed to its end while an ended job was collected, earlier in this round,
                    # is gone: seen on a loaded machine, where the launcher raised KeyError)
                    if reader in outputs:
                        _relay(outputs, reader)
                    continue
                k, proc, slot = running.pop(reader)  # type: ignore[call-overload]
                how = _collect(reader, proc, lambda: _relay_ready(outputs, 0.05))  # type: ignore[arg-type]
                free.insert(_slot_order(slots, free, slot), slot)
                if proc.pid in stop.reached and how.error is not None:
                    continue  # stopped by the signal: interrupted, not ended
                exit_code = exit_code or how.exit_code
                finished(k, how)
    _drain(outputs)
    if stop.signum:
        name = signal.Signals(stop.signum).name
        print(f"hydra/launcher=torchrun: stopped by {name}; every running job was stopped", file=sys.stderr)
        raise SystemExit(128 + stop.signum)
    if exit_code:
        raise SystemExit(exit_code)


def _slot_order(slots: Sequence[DeviceSet], free: list[DeviceSet], slot: DeviceSet) -> int:
    """Where ``slot`` goes back among the free ones: in the order of ``slots`` (lowest devices first)."""
    rank = list(slots).index(slot)
    return sum(list(slots).index(other) < rank for other in free)


# ---------------------------------------------------------------------------------------- job process


def _relay(outputs: dict[int, TaggedOutput], fd: int) -> None:
    output = outputs[fd]
    output.relay(fd)
    if fd not in output.fds():
        del outputs[fd]


def _relay_ready(outputs: dict[int, TaggedOutput], timeout: float) -> None:
    """Relay what the jobs' pipes have within ``timeout`` seconds."""
    if not outputs:
        time.sleep(timeout)
        return
    for fd in wait(list(outputs), timeout=timeout):
        _relay(outputs, fd)  # type: ignore[arg-type]


def _drain(outputs: dict[int, TaggedOutput]) -> None:
    """The ended jobs' last lines, until every pipe's end; those a stray process still holds after
    :data:`_OUTPUT_GRACE_S` are closed."""
    deadline = time.monotonic() + _OUTPUT_GRACE_S
    while outputs and time.monotonic() < deadline:
        for fd in wait(list(outputs), timeout=max(0.0, deadline - time.monotonic())):
            _relay(outputs, fd)  # type: ignore[arg-type]
    for output in set(outputs.values()):
        output.close()
    outputs.clear()


def _job_process(
    job: Callable[[DeviceSet], Any], slot: DeviceSet, writer: Connection, output: TaggedOutput
) -> None:
    """The job process: its own process group, dies with the launcher, writes its console lines into its
    tagged pipes, runs the job, sends how it ended."""
    output.become_job_output()
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _share_the_launchers_fork_server()
    for signum in _STOP_SIGNALS:  # until the job's agent installs its own handlers
        signal.signal(signum, _exit_on_signal)
    _terminated_with_launcher()
    try:
        outcome: tuple[str, Any] = ("value", job(slot))
    except SystemExit as stop:
        code = stop.code
        outcome = ("exit", 0 if code is None else code if isinstance(code, int) else 1)
    except BaseException as error:  # KeyboardInterrupt included: the job failed, the sweep goes on
        outcome = ("error", error)
    writer.send_bytes(_dumps(outcome))
    writer.close()


def _share_the_launchers_fork_server() -> None:
    """Start this job's workers from the fork server the launcher started (which imported torch and the
    app's libraries once), rather than from a server of the job's own, whose imports took seconds before
    every job's first line. ``multiprocessing`` checks on a server it started with ``waitpid``, which fails
    here ("No child processes": the server is the launcher's child), so this process checks on it by its
    pid instead, and starts a server of its own if the launcher's is gone. The workers write into this
    job's tagged pipes and join its process group all the same (:class:`.streams.LaunchingStreams`).
    ``multiprocessing.forkserver``'s private state, 3.10 to 3.13: tests/test_private_apis.py checks it."""
    from multiprocessing import forkserver, resource_tracker

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or pid is None:
        return
    own_check = type(server).ensure_running

    def ensure_running() -> None:
        if server._forkserver_pid == pid and _running(pid):
            resource_tracker.ensure_running()
            return
        with contextlib.suppress(OSError, TypeError):  # gone: start a server of this process's own
            os.close(server._forkserver_alive_fd)
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        forkserver.ensure_running = server.ensure_running = functools.partial(own_check, server)
        server.ensure_running()

    forkserver.ensure_running = server.ensure_running = ensure_running  # the module's name, the instance's


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (not a zombie), on Linux, where packing runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _terminated_with_launcher() -> None:
    """SIGTERM this job process when the launcher exits (``PR_SET_PDEATHSIG``): its agent then stops its
    workers as on any SIGTERM. Not :func:`.lifeline.die_with_parent`, which arms once per process:
    workers forked from here (``start_method=fork``) would inherit it armed, for the wrong parent."""
    import ctypes

    launcher = multiprocessing.parent_process()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if launcher is not None and os.getppid() != launcher.pid:  # it exited before prctl took effect
        raise SystemExit(128 + signal.SIGTERM)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _dumps(outcome: tuple[str, Any]) -> bytes:
    """The outcome pickled; by value (cloudpickle) if pickle cannot; else a failure that says why."""
    try:
        return pickle.dumps(outcome)
    except Exception as error:
        first = error
    try:
        import cloudpickle

        return cloudpickle.dumps(outcome)
    except Exception:
        pass
    what = "value" if outcome[0] == "value" else "exception"
    message = f"the job's {what} cannot be sent back to the launcher: {type(first).__name__}: {first}"
    return pickle.dumps(("error", RuntimeError(message)))


def _collect(
    reader: Connection, proc: multiprocessing.process.BaseProcess, while_waiting: Callable[[], None]
) -> Ended:
    """How a job whose process sent something, or ended, ended. While its process exits, ``while_waiting``
    keeps the jobs' output flowing (a process blocked on a full pipe would never exit)."""
    try:
        data: bytes | None = reader.recv_bytes()
    except (EOFError, OSError):
        data = None
    reader.close()
    proc.join(0.05)
    while proc.exitcode is None:
        while_waiting()
        proc.join(0.05)
    if data is None:
        return Ended(error=RuntimeError(f"the job's process ended without a result ({_how(proc.exitcode)})"))
    try:
        kind, payload = pickle.loads(data)
    except Exception as error:
        return Ended(error=RuntimeError(f"the job's result cannot be read: {type(error).__name__}: {error}"))
    if kind == "value":
        return Ended(value=payload)
    if kind == "exit":
        return Ended(error=RuntimeError(f"the job exited with code {payload}"), exit_code=payload)
    return Ended(error=payload)


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


# ---------------------------------------------------------------------------------------------- signals


class _Stop:
    """The signal that stops the batch, once one came, and which job processes it reached."""

    def __init__(self, running: Callable[[], list[multiprocessing.process.BaseProcess]]) -> None:
        self.running, self.signum, self.reached = running, 0, set()
        self.owner = os.getpid()

    def handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.owner:  # a job process before it set its own handlers
            raise SystemExit(128 + signum)
        self.signum = self.signum or signum
        for proc in self.running():
            self.reach(proc)

    def reach(self, proc: multiprocessing.process.BaseProcess) -> None:
        if self.signum and proc.pid is not None and proc.pid not in self.reached:
            self.reached.add(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, self.signum)


@contextlib.contextmanager
def _stop_on_signals(running: Callable[[], list[multiprocessing.process.BaseProcess]]) -> Iterator[_Stop]:
    stop = _Stop(running)
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signals go to the main thread's handlers: the caller's business there
        return
    previous = {signum: signal.signal(signum, stop.handle) for signum in _STOP_SIGNALS}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
