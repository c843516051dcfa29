"""What ``hydra/sweeper=distsync_optuna`` does (see :mod:`.sweeper` for the behaviour): the study, the sweep
that asks its trials as slots free (:mod:`._trials`), the search space (:mod:`._space`), and the results
written to the sweep dir. Imported by :mod:`.sweeper` only when the sweeper is chosen, so that Hydra's
plugin scan of every app run does not need Optuna.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.errors import ConfigCompositionException
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from distsync import tuning
from hydra_plugins.distsync_optuna_sweeper._heartbeat import Heartbeat
from hydra_plugins.distsync_optuna_sweeper._slots import (
    LaunchOne,
    Slots,
    SubmititJobs,
    is_submitit,
    runs_in_process,
)
from hydra_plugins.distsync_optuna_sweeper._space import directions, grid_choices, search_space
from hydra_plugins.distsync_optuna_sweeper._trials import INTERRUPTED, JOB_DIR, Trials, counts

log = logging.getLogger(__name__)


class AsyncOptunaStudy:
    """The sweep behind :class:`~.sweeper.DistsyncOptunaSweeper`; the options are
    :class:`~.config.DistsyncOptunaSweeperConf`'s."""

    def __init__(
        self,
        sampler: Any,
        pruner: Any,
        direction: Any,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        max_retries: int,
        heartbeat_interval: float,
        grace_period: float | None,
        params: DictConfig | None,
        custom_search_space: str | None,
    ) -> None:
        self.sampler_conf, self.pruner_conf, self.direction = sampler, pruner, direction
        self.storage_url, self.study_name = storage, study_name
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, max(1, n_jobs), max_failure_rate
        self.max_retries = max(0, max_retries)
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = 2 * heartbeat_interval if grace_period is None else grace_period
        self.params, self.custom_search_space = params, custom_search_space
        self.directions: list[str] = []
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # Checked here rather than as the sweeper is built: Hydra prints this exception as its one line.
        if self.custom_search_space:
            raise ConfigCompositionException(
                "hydra.sweeper.custom_search_space is not supported by distsync_optuna: write the search "
                "space in hydra.sweeper.params"
            )
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise ConfigCompositionException(
                f"hydra.sweeper.max_failure_rate must be in [0, 1], got {self.max_failure_rate}"
            )
        if not 0 < self.heartbeat_interval < self.grace_period:
            raise ConfigCompositionException(
                "hydra.sweeper.heartbeat_interval must be > 0 and below hydra.sweeper.grace_period, got "
                f"{self.heartbeat_interval} and {self.grace_period}"
            )
        self.directions = directions(self.direction)
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    # ------------------------------------------------------------------------------------------ sweep

    def sweep(self, arguments: list[str]) -> None:
        assert self.config is not None and self.launcher is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        space, fixed = search_space([*(f"{k}={v}" for k, v in (self.params or {}).items()), *arguments])
        sweep_dir.mkdir(parents=True, exist_ok=True)
        url = self.storage_url or f"journal:{(sweep_dir / 'optuna_journal.log').resolve()}"
        storage = tuning.storage_from_url(url)
        name = self.study_name or "distsync"
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            sampler=self._sampler(space, _trials_in(storage, name)),
            pruner=_instantiate(self.pruner_conf),
            directions=self.directions,
            load_if_exists=True,
        )
        if list(study.directions) != [optuna.study.StudyDirection[d.upper()] for d in self.directions]:
            raise ConfigCompositionException(
                f"hydra.sweeper.direction={self.directions} but the study {study.study_name} in {url} "
                f"was created with {[d.name.lower() for d in study.directions]}"
            )
        before = counts(study)
        log.info(
            f"Study {study.study_name} in {url}: {before.finished} of n_trials={self.n_trials} finished, "
            f"{before.running} running (n_trials counts the study's trials, every sweep's)"
        )
        pruner = _arguments(self.pruner_conf)
        heartbeat = Heartbeat(storage, storage.get_study_id_from_name(name), self.heartbeat_interval)
        runner = Trials(
            study, storage, url, pruner, space, fixed, sweep_dir, self.n_trials,
            heartbeat.sweep_id, self.grace_period,
        )  # fmt: skip
        write = functools.partial(self._write_results, study, sweep_dir)
        slots = None if hasattr(self.launcher, "launch_as_slots_free") else self._slots(runner, sweep_dir)
        with heartbeat, _stop_signals(), _settled_when_stopped(runner, slots, write):
            while True:
                if slots is None:  # distsync's launcher: a trial per free slot of its devices, at once
                    self.launcher.launch_as_slots_free(runner.next_job, runner.finished, runner.jobs_left())
                elif runs_in_process(self.launcher):
                    slots.run_here()
                else:
                    slots.run_threads()
                if not self._waited_for_other_sweeps(runner):
                    break
        self._write_results(study, sweep_dir)
        after = counts(study)
        log.info(
            f"Study {study.study_name}: {after.finished} of n_trials={self.n_trials} finished"
            + (f", {after.running} still running outside distsync's sweeps" if after.running else "")
            + f"; this sweep ran {len(runner.returns)}"
        )
        failed = [ret for ret in runner.returns if ret.status == JobStatus.FAILED]
        total = len(runner.returns)
        if failed and len(failed) / total > self.max_failure_rate:
            log.error(f"{len(failed)} of {total} trials failed (max_failure_rate={self.max_failure_rate})")
            _ = failed[0].return_value  # raises the first failure, its traceback: the sweep exits non-zero

    def _waited_for_other_sweeps(self, runner: Trials) -> bool:
        """Wait while trials of the study run in other sweeps that are alive; whether there were any (they
        ended, or their sweep went silent: this sweep then takes them over)."""
        others = runner.running_elsewhere()
        if not others:
            return False
        log.info(
            f"{others} trial(s) of the study run in another sweep: waiting for them to end, or for that "
            f"sweep's heartbeat to be silent for grace_period={self.grace_period:g} s"
        )
        while runner.running_elsewhere():
            time.sleep(min(5.0, max(0.5, self.heartbeat_interval / 2)))
        return True

    def _slots(self, runner: Trials, sweep_dir: Path) -> Slots:
        if runs_in_process(self.launcher):
            if self.n_jobs > 1:
                log.info(f"Hydra's basic launcher runs one job at a time: trials one after the other, "
                         f"not n_jobs={self.n_jobs} at once")  # fmt: skip
            return Slots(runner, LaunchOne(self.launcher), 1, self.max_retries)
        submitit = is_submitit(self.launcher)
        run_one = (
            SubmititJobs(self.launcher, sweep_dir, runner.record_job)
            if submitit
            else LaunchOne(self.launcher)
        )
        log.info(f"Launching trials as {self.n_jobs} slots free, each trial a job of its own")
        return Slots(runner, run_one, self.n_jobs, self.max_retries)

    def _sampler(self, space: dict[str, BaseDistribution], existing: int) -> optuna.samplers.BaseSampler:
        """The configured sampler; a seeded one, for a study that has ``existing`` trials already, seeded
        with ``seed + existing``: a resumed study does not draw its first trials' parameters again."""
        conf = OmegaConf.to_container(self.sampler_conf, resolve=True) if self.sampler_conf else {}
        if conf.get("seed") is not None and existing:
            conf["seed"] = int(conf["seed"]) + existing
        if conf.get("_target_") == "optuna.samplers.GridSampler":
            conf["search_space"] = {name: grid_choices(name, d) for name, d in space.items()}
            grid = math.prod(len(v) for v in conf["search_space"].values())
            if grid < self.n_trials:
                log.info(f"n_trials {self.n_trials} -> {grid}: the grid has {grid} points")
                self.n_trials = grid
        return _instantiate(conf)

    def _write_results(self, study: optuna.Study, sweep_dir: Path) -> None:
        finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
        if not finished:
            log.warning("no trial completed: no best trial")
        elif len(self.directions) == 1:
            best = study.best_trial
            results: dict[str, Any] = {"name": "optuna", "best_params": best.params, "best_value": best.value}
            results["best_trial"] = {"number": best.number, "job_dir": best.user_attrs.get(JOB_DIR)}
            OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
            log.info(f"Best trial #{best.number}: value {best.value}, parameters {best.params}")
        else:
            front = [{"params": t.params, "values": t.values, "number": t.number} for t in study.best_trials]
            results = {"name": "optuna", "solutions": front}
            OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
            log.info(f"Pareto front: trials {[t.number for t in study.best_trials]}")
        (sweep_dir / "optuna_trials.md").write_text(_trials_table(study, self.directions))


@contextlib.contextmanager
def _settled_when_stopped(
    runner: Trials, slots: Slots | None, write_results: Callable[[], None]
) -> Iterator[None]:
    """Ctrl-C, SIGTERM or an error while trials run: cancel the jobs of ``slots``, tell or leave to the next
    sweep the trials still running (:meth:`Trials.settle_open`), write the results, and raise
    (``SystemExit(130)`` for Ctrl-C)."""
    try:
        yield
    except BaseException as error:
        if slots is not None:
            slots.stop_all()
        try:
            with slots.lock if slots is not None else contextlib.nullcontext():
                runner.settle_open()
            write_results()
        except Exception as settling:  # the storage is gone too: the next sweep takes them over
            log.error(f"the trials still running could not be marked interrupted: {settling!r}")
        if isinstance(error, KeyboardInterrupt) and slots is not None:
            raise SystemExit(130) from None
        raise


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` in the main thread, so that it settles the sweep as Ctrl-C does;
    an ignored SIGINT (a script's background command: the shell starts it so) raises ``KeyboardInterrupt``
    there instead, because the jobs the sweep submits inherit an ignored SIGINT, with which submitit cancels
    a local job: they would train on. A SIGINT handler of the app's own is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _exit)}
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: installed outside Python, which cannot be put back from here
                signal.signal(signum, handler)


def _trials_in(storage: Any, study_name: str) -> int:
    """How many trials the study ``study_name`` has in ``storage`` (0: there is no such study yet)."""
    try:
        return storage.get_n_trials(storage.get_study_id_from_name(study_name))
    except KeyError:
        return 0


def _arguments(conf: Any) -> dict[str, Any]:
    """``conf`` (a node or dict with ``_target_``) as a plain dict, without its unset (None) arguments."""
    if conf is None:
        return {}
    if isinstance(conf, DictConfig):
        conf = OmegaConf.to_container(conf, resolve=True)
    return {k: v for k, v in conf.items() if v is not None}


def _instantiate(conf: Any) -> Any:
    """``conf`` instantiated without its unset (None) arguments."""
    arguments = _arguments(conf)
    return instantiate(arguments) if arguments else None


def _trials_table(study: optuna.Study, directions: list[str]) -> str:
    names = sorted({name for t in study.trials for name in t.params})
    header = ["trial", "state", *(f"value ({d})" for d in directions), *names, "job dir"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for t in study.trials:
        state = t.state.name.lower()
        if t.state == TrialState.PRUNED:
            state = f"**pruned** at step {t.last_step}"
        elif t.user_attrs.get(INTERRUPTED):
            state = (
                "interrupted (the next sweep resumes it)"
                if t.state == TrialState.RUNNING
                else ("interrupted (not counted)")
            )
        values = t.values or [None] * len(directions)
        cells = [str(t.number), state, *("" if v is None else f"{v:.6g}" for v in values)]
        cells += [str(t.params.get(n, "")) for n in names] + [str(t.user_attrs.get(JOB_DIR, ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
