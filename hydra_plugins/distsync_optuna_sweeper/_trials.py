"""The trials of one ``distsync_optuna`` sweep: asked as slots free, told as their jobs end, and the trials
a stopped sweep left behind.

**Job numbers are trial numbers.** Trial #7 runs in the job directory ``<sweep dir>/7`` (with the default
``hydra.sweep.subdir``), so a resumed sweep, or two sweeps of one study sharing a sweep dir, never reuse a
directory.

**n_trials** counts the study's trials, whichever sweep ran them: those finished (completed, pruned,
failed) and those running. A sweep asks for a trial while fewer than ``n_trials`` are, so two sweeps of one
study reach ``n_trials`` together (up to the trials they ask at the same moment), and a resumed one
finishes what the killed one started.

**A stopped sweep's running trials** (Ctrl-C, SIGTERM, or a sweep killed and resumed later) are settled
from what their worlds recorded in the study (:mod:`distsync.tuning`): a trial whose rank 0 had returned
its value is told complete with it, a trial its pruner had stopped is told pruned. Any other was
interrupted: it is told failed, as Optuna fails a trial whose process died (``fail_stale_trials``), with
the user attribute ``distsync_interrupted``, does not count toward ``n_trials``, and its parameters are
queued again as a new trial, as Optuna's heartbeat retry callback queues them (the system attributes
``failed_trial`` and ``retry_history``, which ``RetryHeartbeatStaleTrialCallback.retried_trial_number``
reads): the next sweep of the study runs it first, from the start, in a job directory of its own.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from distsync import tuning
from hydra_plugins.distsync_optuna_sweeper._space import suggest

log = logging.getLogger(__name__)

INTERRUPTED = "distsync_interrupted"  # user attr of a trial whose sweep was stopped while it ran
OWNER = "distsync_sweep"  # user attr: the host and pid of the sweep that asked the trial
JOB_DIR = "job_dir"  # user attr: the trial's job directory
_BOOKKEEPING = (INTERRUPTED, OWNER, JOB_DIR, tuning.PRUNED_AT, tuning.RESULT)


@dataclass
class Counts:
    """The study's trials as ``n_trials`` counts them."""

    finished: int  # completed, pruned or failed (not interrupted)
    running: int  # by any sweep of the study that may still be alive


def counts(study: optuna.Study) -> Counts:
    trials = study.get_trials(deepcopy=False)
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    finished = sum(t.state in done and not t.user_attrs.get(INTERRUPTED) for t in trials)
    running = sum(t.state == TrialState.RUNNING and not _owner_is_gone(t) for t in trials)
    return Counts(finished, running)


class Trials:
    """The trials this sweep asks (``next_job``, as slots free) and tells (``finished``, ``lost``)."""

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
    ) -> None:
        self.study, self.storage, self.url, self.pruner = study, storage, url, pruner
        self.space, self.fixed = space, fixed
        self.sweep_dir, self.n_trials = sweep_dir, n_trials
        self.asked: dict[int, optuna.Trial] = {}  # by trial number, until told
        self.returns: list[JobReturn] = []
        self.relaunched: dict[int, int] = {}  # by trial number: how often its lost job was launched again

    def next_job(self) -> tuple[int, list[str]] | None:
        """The next trial's number and the overrides of its job, or None while the study has ``n_trials``
        trials finished or running."""
        now = counts(self.study)
        if now.finished + now.running >= self.n_trials:
            return None
        trial = self.study.ask()  # a trial queued again after an interruption comes first
        trial.set_user_attr(OWNER, f"{socket.gethostname()}:{os.getpid()}")
        trial.set_user_attr(JOB_DIR, str((self.sweep_dir / str(trial.number)).resolve()))
        for name, distribution in self.space.items():
            suggest(trial, name, distribution)
        self.asked[trial.number] = trial
        overrides = [f"{name}={value}" for name, value in {**trial.params, **self.fixed}.items()]
        trial_id = trial._trial_id  # noqa: SLF001  the storage's id of the trial, which the workers open
        trial_env = tuning.job_overrides(self.url, self.study.study_name, trial_id, self.pruner)
        return trial.number, [*overrides, *trial_env]

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
        """The trials this sweep asked and was not told about (it was stopped): settled from what their
        worlds recorded (see the module docstring)."""
        open_numbers = set(self.asked)
        self.asked.clear()
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if trial.number in open_numbers:
                settle(self.study, self.storage, trial, "the sweep was stopped")


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


def settle_stale(study: optuna.Study, storage: Any) -> None:
    """The trials left running by sweeps of this host that are gone (killed): settled."""
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _owner_is_gone(trial):
            settle(study, storage, trial, "its sweep was killed")


def settle(study: optuna.Study, storage: Any, trial: FrozenTrial, why: str) -> None:
    """Tell ``trial``, which ran when its sweep stopped, complete (its rank 0 had recorded its value),
    pruned (its pruner had stopped it) or failed as interrupted, its parameters queued again."""
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
        storage.set_trial_user_attr(trial._trial_id, INTERRUPTED, True)  # noqa: SLF001
        _tell(study, trial.number, TrialState.FAIL, None)
        retry = _queue_again(study, storage, trial)
        record.update(state="FAIL", values=None, interrupted=True, retried_as=retry)
        log.info(
            f"trial #{trial.number} was running when {why}: interrupted (failed, not counted); its "
            f"parameters are queued again as trial #{retry}"
        )
    if attrs.get(JOB_DIR):
        _write_record(Path(attrs[JOB_DIR]), record)


def _queue_again(study: optuna.Study, storage: Any, trial: FrozenTrial) -> int:
    """A waiting copy of ``trial`` (its parameters, its user attributes but distsync's), marked as Optuna's
    heartbeat retry marks one (``study.add_trial``, by the storage: its number is known); its number."""
    system_attrs: dict[str, Any] = {"failed_trial": trial.number, "retry_history": [], **trial.system_attrs}
    system_attrs["retry_history"] = [*system_attrs["retry_history"], trial.number]
    waiting = optuna.create_trial(
        state=TrialState.WAITING,
        params=trial.params,
        distributions=trial.distributions,
        user_attrs={k: v for k, v in trial.user_attrs.items() if k not in _BOOKKEEPING},
        system_attrs=system_attrs,
    )
    study_id = storage.get_study_id_from_name(study.study_name)
    trial_id = storage.create_new_trial(study_id, template_trial=waiting)
    return storage.get_trial_number_from_id(trial_id)


def _tell(study: optuna.Study, number: int, state: TrialState, values: list[float] | None) -> None:
    try:
        study.tell(number, values=values, state=state)
    except RuntimeError as error:  # the grid sampler stops the study once its grid is done
        if "Study.stop" not in str(error):
            raise


def _owner_is_gone(trial: FrozenTrial) -> bool:
    """Whether the sweep that asked ``trial`` ran on this host and is gone (another host's: not known)."""
    owner = str(trial.user_attrs.get(OWNER, ""))
    host, _, pid = owner.rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _job_dir(ret: JobReturn) -> Path | None:
    hydra_cfg = getattr(ret, "hydra_cfg", None)
    try:
        return Path(str(hydra_cfg.hydra.runtime.output_dir)).resolve() if hydra_cfg is not None else None
    except AttributeError:
        return None


def _write_record(job_dir: Path, record: dict[str, Any]) -> None:
    if job_dir.is_dir():
        OmegaConf.save(OmegaConf.create(record), job_dir / "trial.yaml")
