"""The trials of one ``distsync_optuna`` sweep: asked as slots free, told as their jobs end, and the trials
of sweeps that are gone, resumed.

**Job numbers are trial numbers.** Trial #7 runs in the job directory ``<sweep dir>/7`` (with the default
``hydra.sweep.subdir``), so a resumed sweep, or two sweeps of one study sharing a sweep dir, never reuse a
directory, and a trial run again runs where its checkpoint is.

**n_trials** counts the study's trials, whichever sweep ran them: those finished (completed, pruned,
failed) and those running. A sweep asks for a trial while fewer than ``n_trials`` are, so two sweeps of one
study reach ``n_trials`` together (up to the trials they ask at the same moment), and a sweep ends only when
no trial of the study runs in another sweep that is alive: when it ends, the study has its ``n_trials``.

**A trial whose sweep is gone** (its heartbeat stopped: :mod:`._heartbeat`) is taken over by the next sweep
of the study that sees it, under its own number: told complete if its rank 0 had recorded its value
(:func:`distsync.tuning.report_result`), pruned if its pruner had stopped it, and otherwise resumed in its
job directory, where the job goes on from its checkpoint. Where its job still runs (a SLURM job or a
submitit local job outlives a sweep killed with SIGKILL), the new sweep waits for that job instead of
starting another, so nothing it computed is lost and its result is never refused. A sweep stopped by Ctrl-C
or SIGTERM stops the jobs it started (their ranks save a checkpoint) and leaves their trials running,
marked ``distsync_interrupted``, to the next sweep, which resumes them at once.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from distsync import tuning
from hydra_plugins.distsync_optuna_sweeper._heartbeat import OWNER, owner, silent_for
from hydra_plugins.distsync_optuna_sweeper._space import suggest

log = logging.getLogger(__name__)

INTERRUPTED = "distsync_interrupted"  # user attr: its sweep was stopped while it ran (the next resumes it)
JOB = "distsync_job"  # user attr: the job that runs the trial, as the launcher's slots name it
JOB_DIR = "job_dir"  # user attr: the trial's job directory


@dataclass
class Counts:
    """The study's trials as ``n_trials`` counts them."""

    finished: int  # completed, pruned or failed (not the interrupted ones older releases failed)
    running: int  # by any sweep, alive or to be resumed


def counts(study: optuna.Study) -> Counts:
    trials = study.get_trials(deepcopy=False)
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    finished = sum(t.state in done and not t.user_attrs.get(INTERRUPTED) for t in trials)
    running = sum(t.state == TrialState.RUNNING for t in trials)
    return Counts(finished, running)


class Trials:
    """The trials this sweep asks or resumes (``next_job``, as slots free) and tells (``finished``,
    ``lost``); ``sweep_id`` is this sweep's heartbeat's, ``grace_period`` how long another sweep's heartbeat
    may be silent before its trials are this sweep's."""

    def __init__(
        self,
        study: optuna.Study,
        storage: Any,
        url: str,
        pruner: dict[str, Any],
        space: dict[str, BaseDistribution],
        fixed: dict[str, str],
        sweep_dir: Path,
        n_trials: int,
        sweep_id: str,
        grace_period: float,
    ) -> None:
        self.study, self.storage, self.url, self.pruner = study, storage, url, pruner
        self.space, self.fixed = space, fixed
        self.sweep_dir, self.n_trials = sweep_dir, n_trials
        self.sweep_id, self.grace_period = sweep_id, grace_period
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self.asked: dict[int, optuna.Trial] = {}  # by trial number, until told
        self.returns: list[JobReturn] = []
        self.relaunched: dict[int, int] = {}  # by trial number: how often its lost job was launched again
        self.resumed: set[int] = set()  # the trials of gone sweeps this sweep took over
        self.adopted_jobs: dict[int, str] = {}  # by trial number: the job a gone sweep left running it

    def next_job(self) -> tuple[int, list[str]] | None:
        """The next trial's number and the overrides of its job: a trial of a gone sweep first, else a new
        one; None while the study has ``n_trials`` trials finished or running."""
        resumed = self._take_over_one()
        if resumed is not None:
            return resumed
        now = counts(self.study)
        if now.finished + now.running >= self.n_trials:
            return None
        trial = self.study.ask()
        trial.set_user_attr(OWNER, self.sweep_id)
        trial.set_user_attr(JOB_DIR, str((self.sweep_dir / str(trial.number)).resolve()))
        for name, distribution in self.space.items():
            suggest(trial, name, distribution)
        self.asked[trial.number] = trial
        return trial.number, self._overrides(trial)

    def _overrides(self, trial: optuna.Trial) -> list[str]:
        overrides = [f"{name}={value}" for name, value in {**trial.params, **self.fixed}.items()]
        trial_id = trial._trial_id  # noqa: SLF001  the storage's id of the trial, which the workers open
        return [*overrides, *tuning.job_overrides(self.url, self.study.study_name, trial_id, self.pruner)]

    def _gone(self, beats: dict[str, Any], now: float) -> list[FrozenTrial]:
        """The study's running trials whose distsync sweep is gone (silent past the grace period), from the
        study's system attributes ``beats`` at time ``now``."""
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        return [
            t
            for t in running
            if owner(t) != self.sweep_id and (silent_for(t, beats, now) or 0.0) > self.grace_period
        ]

    def _take_over_one(self) -> tuple[int, list[str]] | None:
        """Take over the trials of gone sweeps: each told as its world recorded, or the first to resume
        returned (its number and overrides; :attr:`adopted_jobs` has its job if it may still run)."""
        beats, now = self.storage.get_study_system_attrs(self.study_id), time.time()
        for frozen in self._gone(beats, now):
            if settle_as_recorded(self.study, frozen, "its sweep was gone"):
                continue
            trial_id = frozen._trial_id  # noqa: SLF001
            self.storage.set_trial_user_attr(trial_id, OWNER, self.sweep_id)
            if owner(self.storage.get_trial(trial_id)) != self.sweep_id:
                continue  # another sweep took it over at the same moment, and wrote after this one
            self.storage.set_trial_user_attr(trial_id, INTERRUPTED, False)
            trial = optuna.Trial(self.study, trial_id)
            self.asked[frozen.number] = trial
            self.resumed.add(frozen.number)
            job = frozen.user_attrs.get(JOB)
            if job:
                self.adopted_jobs[frozen.number] = str(job)
            silent = silent_for(frozen, beats, now) or 0.0
            why = "it ended" if math.isinf(silent) else f"its heartbeat silent for {silent:.1f} s"
            log.info(
                f"trial #{frozen.number}: its sweep is gone ({why}); this sweep resumes it in its job dir"
                + (f" (its job {job} first, while it runs)" if job else "")
            )
            return frozen.number, self._overrides(trial)
        return None

    def running_elsewhere(self) -> int:
        """How many of the study's trials run in other distsync sweeps that are alive."""
        beats = self.storage.get_study_system_attrs(self.study_id)
        now = time.time()
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        return sum(
            owner(t) not in (None, self.sweep_id) and (silent_for(t, beats, now) or 0.0) <= self.grace_period
            for t in running
        )

    def jobs_left(self) -> int:
        """How many more trials this sweep may run: ``n_trials`` less those finished or alive elsewhere."""
        return max(1, self.n_trials - counts(self.study).finished - self.running_elsewhere())

    def record_job(self, number: int, job: str) -> None:
        """Trial ``number`` runs in ``job``: a sweep that takes it over waits for that job while it runs."""
        self.storage.set_trial_user_attr(self.asked[number]._trial_id, JOB, job)  # noqa: SLF001

    def finished(self, number: int, ret: JobReturn) -> None:
        """Tell the study how trial ``number``'s job ended."""
        trial = self.asked.pop(number)
        self.returns.append(ret)
        job_dir = _job_dir(ret) or Path(str(self.sweep_dir / str(number))).resolve()
        trial.set_user_attr(JOB_DIR, str(job_dir))
        pruned_at = self.storage.get_trial_user_attrs(trial._trial_id).get(tuning.PRUNED_AT)  # noqa: SLF001
        if ret.status == JobStatus.FAILED:
            state, values = TrialState.FAIL, None
            log.warning(f"trial #{number} failed: {ret._return_value!r}")  # noqa: SLF001
        elif pruned_at is not None:
            state, values = TrialState.PRUNED, None
            log.info(f"trial #{number} pruned at step {pruned_at}")
        else:
            try:
                values = returned_values(ret.return_value, len(self.study.directions))
                state = TrialState.COMPLETE
            except ValueError as error:
                state, values = TrialState.FAIL, None
                ret.status, ret._return_value = JobStatus.FAILED, error  # noqa: SLF001
                log.warning(f"trial #{number} failed: {error}")
        _tell(self.study, number, state, values)
        record = {"number": number, "state": state.name, "values": values, "params": trial.params}
        if pruned_at is not None:
            record["pruned_at_step"] = pruned_at
        if self.relaunched.get(number):
            record["relaunched"] = self.relaunched[number]
        if number in self.resumed:
            record["resumed_from_a_gone_sweep"] = True
        _write_record(job_dir, record)

    def lost(self, number: int, error: BaseException, retry: bool) -> bool:
        """Trial ``number``'s job ended without a result (``error``: cancelled, preempted, timed out); whether
        to launch it again, with the same parameters in the same job directory (``retry`` allows it). A
        trial whose rank 0 had recorded its value, or whose pruner had stopped it, is told complete or
        pruned instead; a trial not launched again is told failed with ``error``."""
        trial = self.asked[number]
        attrs = self.storage.get_trial_user_attrs(trial._trial_id)  # noqa: SLF001
        first_line = str(error).splitlines()[0] if str(error) else repr(error)
        if attrs.get(tuning.RESULT) is not None or attrs.get(tuning.PRUNED_AT) is not None:
            log.info(f"trial #{number}: its job ended without a result ({first_line}) after its world had "
                     "recorded its outcome: told as recorded")  # fmt: skip
            recorded = JobReturn(status=JobStatus.COMPLETED, _return_value=attrs.get(tuning.RESULT))
            self.finished(number, recorded)
            return False
        if retry:
            self.relaunched[number] = self.relaunched.get(number, 0) + 1
            log.warning(
                f"trial #{number}: its job ended without a result ({first_line}); launching it again in its "
                f"job dir (relaunch {self.relaunched[number]}), where it resumes from its checkpoint"
            )
            return True
        log.warning(f"trial #{number}: its job ended without a result ({first_line}), no retry left: failed")
        self.finished(number, JobReturn(status=JobStatus.FAILED, _return_value=error))
        return False

    def settle_open(self) -> None:
        """The trials this sweep runs and was not told about (it is being stopped): told as their worlds
        recorded, or left running, marked interrupted, for the next sweep of the study to resume."""
        for number, trial in sorted(self.asked.items()):
            frozen = self.storage.get_trial(trial._trial_id)  # noqa: SLF001
            if frozen.state != TrialState.RUNNING or settle_as_recorded(
                self.study, frozen, "the sweep stopped"
            ):
                continue
            self.storage.set_trial_user_attr(frozen._trial_id, INTERRUPTED, True)  # noqa: SLF001
            log.info(f"trial #{number} was running when the sweep stopped: the next sweep of the study "
                     "resumes it in its job dir")  # fmt: skip
        self.asked.clear()


def returned_values(returned: Any, objectives: int) -> list[float]:
    """What a trial's task returned, as the study's values; ``ValueError`` saying why it cannot be."""
    values = list(returned) if isinstance(returned, list | tuple) else [returned]
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(
            f"a trial's task must return {objectives} float-castable value(s), got {returned!r}"
        ) from None
    if len(values) != objectives:
        raise ValueError(
            f"the task returned {len(values)} value(s) for {objectives} objective(s): {returned!r}"
        )
    return values


def settle_as_recorded(study: optuna.Study, trial: FrozenTrial, why: str) -> bool:
    """Tell ``trial``, still running when ``why``, as its world recorded it: complete (its rank 0 had
    returned its value), pruned (its pruner had stopped it); False if it recorded neither."""
    attrs = trial.user_attrs
    record: dict[str, Any] = {"number": trial.number, "params": trial.params}
    values = None
    if attrs.get(tuning.RESULT) is not None:
        try:
            values = returned_values(attrs[tuning.RESULT], len(study.directions))
        except ValueError:
            values = None
    if attrs.get(tuning.PRUNED_AT) is not None:
        _tell(study, trial.number, TrialState.PRUNED, None)
        record.update(state="PRUNED", values=None, pruned_at_step=attrs[tuning.PRUNED_AT])
        log.info(f"trial #{trial.number} was pruned at step {attrs[tuning.PRUNED_AT]} when {why}: pruned")
    elif values is not None:
        _tell(study, trial.number, TrialState.COMPLETE, values)
        record.update(state="COMPLETE", values=values)
        log.info(f"trial #{trial.number} had returned {values} when {why}: complete")
    else:
        return False
    if attrs.get(JOB_DIR):
        _write_record(Path(attrs[JOB_DIR]), record)
    return True


def _tell(study: optuna.Study, number: int, state: TrialState, values: list[float] | None) -> None:
    try:  # a trial another sweep told meanwhile (both took it over) is left as told
        study.tell(number, values=values, state=state, skip_if_finished=True)
    except RuntimeError as error:  # the grid sampler stops the study once its grid is done
        if "Study.stop" not in str(error):
            raise


def _job_dir(ret: JobReturn) -> Path | None:
    hydra_cfg = getattr(ret, "hydra_cfg", None)
    try:
        return Path(str(hydra_cfg.hydra.runtime.output_dir)).resolve() if hydra_cfg is not None else None
    except AttributeError:
        return None


def _write_record(job_dir: Path, record: dict[str, Any]) -> None:
    if job_dir.is_dir():
        OmegaConf.save(OmegaConf.create(record), job_dir / "trial.yaml")
