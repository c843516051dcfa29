"""The trials of a ``distsync_optuna`` sweep through a launcher other than distsync's: ``n_jobs`` slots, each
asking the next trial the moment its last one ended and launching it alone, and trials whose job was lost
launched again.

**Slots.** Hydra's basic launcher runs a job in the sweep's own process (it changes the working directory
and the logging of that process), so with it trials run one after the other, each asked as the last ends.
Any other launcher runs ``hydra.sweeper.n_jobs`` slots, one thread each, whose trial is a job of its own
(``launcher.launch([overrides], number)``). Hydra's submitit launchers (``submitit_slurm``,
``submitit_local``) are not called through ``launch``, which waits on its jobs without a way to stop them:
each trial is submitted the way that ``launch`` submits it (the launcher's own executor parameters, the
launcher itself as the job's function, the trial's number as ``hydra.job.num``), and the sweep holds the
job, so that a stopped sweep cancels the jobs it started.

**A lost job** is one that ended without a result: its SLURM job was cancelled (``scancel``), preempted,
requeued and failed, timed out past submitit's own requeues, or its node failed (submitit's
``UncompletedJobError``). Its trial keeps its parameters and its number, so its job directory too, and is
launched again there, up to ``hydra.sweeper.max_retries`` times: the packaged job resumes from the
checkpoint in that directory. A trial whose rank 0 had recorded its value
(:func:`distsync.tuning.report_result`) or whose pruner had stopped it is told complete or pruned instead,
never run again. On a cluster without
SLURM accounting (``sacct`` says so), where submitit never learns that a job ended without a result, the
sweep asks ``squeue`` instead.

**Jobs outlive a killed sweep.** Each submitted job is recorded in its trial (``slurm:<job id>``, or for
``submitit_local`` ``local:<pid>:<start time>``, which no other process, PID namespace or host can match),
so that the sweep that takes over a killed sweep's trial waits for its job while it runs, rather than
starting a second one in the same directory; a job that ended without a result is launched again.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus

from hydra_plugins.distsync_optuna_sweeper._trials import Trials

log = logging.getLogger(__name__)

_STATE_EVERY_S = 10.0  # how often a waiting slot asks the scheduler about its job (sacct, squeue)
_RESULT_WAIT_S = 15.0  # how long an ended job's result file may take to appear (a slow shared filesystem)
# squeue's states of a job that has ended (a job squeue no longer knows has ended too)
_ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
          "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT"}  # fmt: skip


class JobLost(Exception):
    """A trial's job ended without a result (cancelled, preempted, timed out, its node failed)."""


class _Stopped(Exception):
    """The sweep is stopping: the slot's job was cancelled, its trial is settled by the sweep."""


def lost_job_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that say a trial's job ended without a result: ours, and submitit's."""
    try:
        from submitit.core.utils import UncompletedJobError
    except ImportError:
        return (JobLost,)
    return (JobLost, UncompletedJobError)


def failed_job_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that say a trial's job failed outside its task (submitit's: composing its config)."""
    try:
        from submitit.core.utils import FailedJobError
    except ImportError:
        return ()
    return (FailedJobError,)


def runs_in_process(launcher: Any) -> bool:
    """Whether ``launcher`` runs jobs in the sweep's own process (Hydra's basic launcher)."""
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    return isinstance(launcher, BasicLauncher)


def is_submitit(launcher: Any) -> bool:
    return type(launcher).__module__.startswith("hydra_plugins.hydra_submitit_launcher") and hasattr(
        launcher, "params"
    )


RunOne = Callable[[int, Sequence[str], threading.Event, "str | None"], JobReturn]
"""``run_one(number, overrides, stop, job)``: trial ``number``'s job, or ``job`` (its record, see
:meth:`SubmititJobs.record`) where a gone sweep left it running; returns how it ended."""


class LaunchOne:
    """Runs one trial's job through ``launcher.launch([overrides], number)``; cannot stop it, nor wait for
    a job another sweep started (a trial taken over is launched again, where it resumes)."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def __call__(
        self, number: int, overrides: Sequence[str], stop: threading.Event, job: str | None = None
    ) -> JobReturn:
        (ret,) = self.launcher.launch([list(overrides)], number)
        return ret

    def cancel_all(self) -> None:
        """Nothing to cancel: the launcher owns its jobs."""


class SubmititJobs:
    """Submits one trial's job as Hydra's submitit launcher submits a sweep's jobs, and waits for it;
    ``on_submit(number, job)`` records each job in its trial."""

    def __init__(self, launcher: Any, sweep_dir: Path, on_submit: Callable[[int, str], None]) -> None:
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        self.launcher, self.sweep_dir, self.on_submit = launcher, sweep_dir, on_submit
        kind = launcher._EXECUTOR  # noqa: SLF001  "slurm" or "local", the launcher's own executor
        params = dict(launcher.params)
        init = {"folder": params.pop("submitit_folder")}
        self.kind, self.folder = kind, init["folder"]
        if "max_num_timeout" in params:
            init[f"{kind}_max_num_timeout"] = params.pop("max_num_timeout")
        self.executor = submitit.AutoExecutor(cluster=kind, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        self.executor.update_parameters(**{k if k in base else f"{kind}_{k}": v for k, v in params.items()})
        self.slurm = kind == "slurm"
        self.sacct = True  # False where sacct says "accounting storage is disabled"
        self.running: dict[int, Any] = {}  # trial number -> its submitit job
        self.local_starts: dict[str, str] = {}  # pid of a local job this sweep did not start -> its start
        self.lock = threading.Lock()

    def __call__(
        self, number: int, overrides: Sequence[str], stop: threading.Event, job: str | None = None
    ) -> JobReturn:
        from hydra.core.singleton import Singleton

        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        adopted = self._adopt(job) if job else None
        with self.lock:  # submitit's executor is not known to be thread-safe
            if stop.is_set():  # the sweep is stopping: it has listed the jobs to cancel, or lists them now
                raise _Stopped
            if adopted is None:
                submitted = self.executor.submit(
                    self.launcher, list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}",
                    Singleton.get_state(),
                )  # fmt: skip
            self.running[number] = adopted or submitted
        if adopted is None:
            self.on_submit(number, self.record(submitted))
            log.info(f"\t#{number} : submitted as job {submitted.job_id}")
        try:
            result = self._wait(self.running[number], stop, check_now=adopted is not None)
        except _Stopped:
            # Still listed: the sweep stops its slots, then cancels what is listed (:meth:`cancel_all`),
            # and a slot may stop first.
            raise
        except BaseException:
            self._forget(number)
            raise
        self._forget(number)
        return result

    def _forget(self, number: int) -> None:
        with self.lock:
            self.running.pop(number, None)

    def record(self, job: Any) -> str:
        """How a trial records ``job``: ``slurm:<id>``, or ``local:<pid>:<start time>`` (a pid alone could
        be another process's by the time another sweep reads it)."""
        if self.slurm:
            return f"slurm:{job.job_id}"
        return f"local:{job.job_id}:{_process_start(str(job.job_id))}"

    def _adopt(self, job: str) -> Any | None:
        """The submitit job recorded as ``job`` by a sweep now gone (None: another launcher's); one that
        ended is returned too, and is found ended at once."""
        import submitit

        kind, _, rest = job.partition(":")
        if kind != self.kind:
            return None
        if self.slurm:
            log.info(f"waiting for job {rest}, which the gone sweep left running")
            return submitit.SlurmJob(folder=self.folder, job_id=rest)
        pid, _, start = rest.partition(":")
        self.local_starts[pid] = start
        return submitit.LocalJob(folder=self.folder, job_id=pid)

    def _wait(self, job: Any, stop: threading.Event, check_now: bool = False) -> JobReturn:
        """Task 0's return (a job of several nodes runs a task on each, Hydra's launcher takes task 0's)."""
        job = job.task(0)  # the job itself when it has one task
        asked = time.monotonic() - (_STATE_EVERY_S if check_now else 0.0)
        while not job.paths.result_pickle.exists():
            if time.monotonic() - asked >= _STATE_EVERY_S:
                asked = time.monotonic()
                if self._ended(job):
                    self._raise_if_no_result(job)
                    break
            if stop.wait(1.0):
                raise _Stopped
        return job.result()  # submitit's FailedJobError where the job's function raised

    def _ended(self, job: Any) -> bool:
        if str(job.job_id) in self.local_starts:  # a local job this sweep did not start: not its child
            return _process_start(str(job.job_id)) != self.local_starts[str(job.job_id)]
        if self.sacct and job.done(force_check=True):
            return True
        if not self.slurm:
            return False
        if self.sacct:  # sacct (submitit's way) answers, or says that this cluster keeps no accounting
            if job.state != "UNKNOWN" or _sacct_answers(str(job.job_id)):
                return False
            log.info("sacct: no accounting on this cluster; the sweep watches its jobs with squeue")
            self.sacct = False
        return _squeue_ended(str(job.job_id))

    def _raise_if_no_result(self, job: Any) -> None:
        deadline = time.monotonic() + _RESULT_WAIT_S
        while not job.paths.result_pickle.exists():
            if time.monotonic() > deadline:
                raise JobLost(f"job {job.job_id} ended without a result (state: {job.state})")
            time.sleep(1.0)

    def cancel_all(self) -> None:
        """Cancel the jobs still running (each saves its checkpoint first: SLURM sends SIGTERM)."""
        with self.lock:
            jobs = list(self.running.values())
        for job in jobs:
            log.info(f"cancelling job {job.job_id}")
            try:
                if str(job.job_id) in self.local_starts:
                    if not self._ended(job):
                        os.kill(int(job.job_id), signal.SIGINT)  # as submitit cancels a local job
                    continue
                job.cancel(check=False)
            except Exception as error:  # noqa: BLE001  gone already, or the scheduler unreachable
                log.warning(f"could not cancel job {job.job_id}: {error!r}")


def _process_start(pid: str) -> str:
    """When process ``pid`` of this PID namespace started (clock ticks since boot), "" if none runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return "" if fields[0] == "Z" else fields[19]


def _sacct_answers(job_id: str) -> bool:
    proc = subprocess.run(["sacct", "--noheader", f"--jobs={job_id}"], capture_output=True, timeout=60)
    return proc.returncode == 0


def _squeue_ended(job_id: str) -> bool:
    command = ["squeue", "--noheader", "--format=%T", f"--jobs={job_id}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    states = proc.stdout.split()
    if proc.returncode != 0:
        return "Invalid job id" in proc.stderr  # the controller forgot it: it ended long ago
    return not states or all(s in _ENDED for s in states)


class Slots:
    """Runs ``n_slots`` slots over ``trials`` with ``run_one`` (see the module docstring)."""

    def __init__(
        self,
        trials: Trials,
        run_one: RunOne,
        n_slots: int,
        max_retries: int,
    ) -> None:
        self.trials, self.run_one, self.n_slots, self.max_retries = trials, run_one, n_slots, max_retries
        self.lock = threading.Lock()  # the trials' bookkeeping and the study, asked and told by every slot
        self.stop = threading.Event()
        self.errors: list[BaseException] = []

    def run_here(self) -> None:
        """One slot, in this thread (a launcher that runs jobs in the sweep's process)."""
        self._slot()

    def run_threads(self) -> None:
        """``n_slots`` slots, each a thread; Ctrl-C or SIGTERM reach this (the main) thread, which then stops
        them (see :meth:`stop_all`) and raises."""
        threads = [threading.Thread(target=self._guarded_slot, name=f"slot-{i}", daemon=True)
                   for i in range(self.n_slots)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
        if self.errors:
            raise self.errors[0]

    def stop_all(self) -> None:
        """Stop the slots: no trial is asked, the jobs they wait for are cancelled by ``cancel``."""
        self.stop.set()
        cancel = getattr(self.run_one, "cancel_all", None)
        if cancel is not None:
            cancel()

    def _guarded_slot(self) -> None:
        try:
            self._slot()
        except BaseException as error:  # noqa: BLE001  the main thread raises it, the other slots stop
            self.errors.append(error)
            self.stop.set()

    def _slot(self) -> None:
        lost, failed = lost_job_errors(), failed_job_errors()
        while not self.stop.is_set():
            with self.lock:
                job = self.trials.next_job()
            if job is None:
                return
            number, overrides = job
            with self.lock:
                left_running = self.trials.adopted_jobs.pop(number, None)
            attempt = 0
            while True:
                try:
                    ret = self.run_one(number, overrides, self.stop, left_running)
                    left_running = None
                except _Stopped:
                    return  # the sweep settles the trial
                except lost as error:
                    if self.stop.is_set():
                        return
                    with self.lock:
                        # a job a gone sweep left is not one of this sweep's retries: always launched again
                        retry = left_running is not None or attempt < self.max_retries
                        again = self.trials.lost(number, error, retry=retry)
                    if again:
                        attempt += 1 if left_running is None else 0
                        left_running = None
                        continue
                except failed as error:
                    with self.lock:
                        self.trials.finished(number, JobReturn(status=JobStatus.FAILED, _return_value=error))
                else:
                    with self.lock:
                        self.trials.finished(number, ret)
                break
