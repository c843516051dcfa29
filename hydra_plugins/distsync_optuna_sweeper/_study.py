"""What ``hydra/sweeper=distsync_optuna`` does (see :mod:`.sweeper` for the behaviour): the study, its
trials asked as slots free and told as they end, the search space read from Hydra's override syntax, and
the results written to the sweep dir. Imported by :mod:`.sweeper` only when the sweeper is chosen, so that
Hydra's plugin scan of every app run does not need Optuna.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import ConfigCompositionException
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from distsync import tuning

log = logging.getLogger(__name__)

_INTERRUPTED = "distsync_interrupted"  # user attr of a trial whose sweep was killed while it ran
_OWNER = "distsync_sweep"  # user attr: the host and pid of the sweep that asked the trial


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
        params: DictConfig | None,
        custom_search_space: str | None,
    ) -> None:
        if custom_search_space:
            raise ConfigCompositionException(
                "hydra.sweeper.custom_search_space is not supported by distsync_optuna: write the search "
                "space in hydra.sweeper.params"
            )
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ConfigCompositionException(
                f"hydra.sweeper.max_failure_rate must be in [0, 1], got {max_failure_rate}"
            )
        self.sampler_conf, self.pruner_conf = sampler, pruner
        directions = list(direction) if isinstance(direction, (list, tuple)) else [direction]
        self.directions = [str(d).split(".")[-1] for d in directions]  # "Direction.minimize": Hydra's enum
        self.storage_url, self.study_name = storage, study_name
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, max(1, n_jobs), max_failure_rate
        self.params = params
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    # ------------------------------------------------------------------------------------------ sweep

    def sweep(self, arguments: list[str]) -> None:
        assert self.config is not None and self.launcher is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        space, fixed = search_space([*(f"{k}={v}" for k, v in (self.params or {}).items()), *arguments])
        url = self.storage_url or f"journal:{(sweep_dir / 'optuna_journal.log').resolve()}"
        storage = tuning.storage_from_url(url)
        study = optuna.create_study(
            study_name=self.study_name or "distsync",
            storage=storage,
            sampler=self._sampler(space),
            pruner=_instantiate(self.pruner_conf),
            directions=self.directions,
            load_if_exists=True,
        )
        _fail_interrupted_trials(study, storage)
        log.info(f"Study {study.study_name} in {url}: {_finished(study)} of {self.n_trials} trials finished")
        pruner = _arguments(self.pruner_conf)
        runner = _Trials(study, storage, url, pruner, space, fixed, sweep_dir, self.n_trials)
        if hasattr(self.launcher, "launch_as_slots_free"):  # distsync's: a trial per free slot, at once
            self.launcher.launch_as_slots_free(runner.next, runner.finished, 0, max_jobs=self.n_trials)
        else:  # any other launcher: batches of n_jobs, as it takes them
            while (batch := runner.batch(self.n_jobs)) is not None:
                returns = self.launcher.launch([overrides for _, overrides in batch], batch[0][0])
                for (idx, _), ret in zip(batch, returns, strict=True):
                    runner.finished(idx, ret)
        self._write_results(study, sweep_dir, runner)
        failed = [ret for ret in runner.returns if ret.status == JobStatus.FAILED]
        total = len(runner.returns)
        if failed and len(failed) / total > self.max_failure_rate:
            log.error(f"{len(failed)} of {total} trials failed (max_failure_rate={self.max_failure_rate})")
            _ = failed[0].return_value  # raises the first failure, its traceback: the sweep exits non-zero

    def _sampler(self, space: dict[str, BaseDistribution]) -> optuna.samplers.BaseSampler:
        conf = OmegaConf.to_container(self.sampler_conf, resolve=True) if self.sampler_conf else {}
        if conf.get("_target_") == "optuna.samplers.GridSampler":
            conf["search_space"] = {name: _grid_choices(name, d) for name, d in space.items()}
            grid = math.prod(len(v) for v in conf["search_space"].values())
            if grid < self.n_trials:
                log.info(f"n_trials {self.n_trials} -> {grid}: the grid has {grid} points")
                self.n_trials = grid
        return _instantiate(conf)

    def _write_results(self, study: optuna.Study, sweep_dir: Path, runner: _Trials) -> None:
        finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
        if not finished:
            log.warning("no trial completed: no best trial")
        elif len(self.directions) == 1:
            best = study.best_trial
            results: dict[str, Any] = {"name": "optuna", "best_params": best.params, "best_value": best.value}
            results["best_trial"] = {"number": best.number, "job_dir": best.user_attrs.get("job_dir")}
            OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
            log.info(f"Best trial #{best.number}: value {best.value}, parameters {best.params}")
        else:
            front = [{"params": t.params, "values": t.values, "number": t.number} for t in study.best_trials]
            results = {"name": "optuna", "solutions": front}
            OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
        (sweep_dir / "optuna_trials.md").write_text(_trials_table(study, self.directions))


class _Trials:
    """The trials of one sweep: asked when a slot frees (or a batch is due), told as their jobs end."""

    def __init__(self, study, storage, url: str, pruner, space, fixed, sweep_dir: Path, n_trials: int):
        self.study, self.storage, self.url, self.pruner = study, storage, url, pruner
        self.space, self.fixed = space, fixed
        self.sweep_dir, self.n_trials = sweep_dir, n_trials
        self.asked: dict[int, optuna.Trial] = {}  # by job index
        self.next_idx = 0
        self.returns: list[JobReturn] = []
        self.to_ask = n_trials - _finished(study)

    def next(self) -> list[str] | None:
        """The overrides of the next trial's job, or None once ``n_trials`` have been asked."""
        if self.to_ask <= 0:
            return None
        self.to_ask -= 1
        trial = self.study.ask()
        trial.set_user_attr(_OWNER, f"{socket.gethostname()}:{os.getpid()}")
        for name, distribution in self.space.items():
            _suggest(trial, name, distribution)
        idx, self.next_idx = self.next_idx, self.next_idx + 1
        self.asked[idx] = trial
        overrides = [f"{name}={value}" for name, value in {**trial.params, **self.fixed}.items()]
        trial_id = trial._trial_id  # noqa: SLF001  the storage's id of the trial, which the workers open
        return [*overrides, *tuning.job_overrides(self.url, self.study.study_name, trial_id, self.pruner)]

    def batch(self, size: int) -> list[tuple[int, list[str]]] | None:
        batch = []
        while len(batch) < size and (overrides := self.next()) is not None:
            batch.append((self.next_idx - 1, overrides))
        return batch or None

    def finished(self, idx: int, ret: JobReturn) -> None:
        trial = self.asked.pop(idx)
        self.returns.append(ret)
        job_dir = (self.sweep_dir / str(idx)).resolve()
        trial.set_user_attr("job_dir", str(job_dir))
        pruned_at = self.storage.get_trial_user_attrs(trial._trial_id).get(tuning.PRUNED_AT)  # noqa: SLF001
        if ret.status == JobStatus.FAILED:
            state, values = TrialState.FAIL, None
            log.warning(f"trial #{trial.number} failed: {ret._return_value!r}")  # noqa: SLF001
        elif pruned_at is not None:
            state, values = TrialState.PRUNED, None
            log.info(f"trial #{trial.number} pruned at step {pruned_at}")
        else:
            try:
                values = _values(ret.return_value, len(self.study.directions))
                state = TrialState.COMPLETE
            except ValueError as error:
                state, values = TrialState.FAIL, None
                ret.status, ret._return_value = JobStatus.FAILED, error  # noqa: SLF001
                log.warning(f"trial #{trial.number} failed: {error}")
        try:
            self.study.tell(trial, values=values, state=state)
        except RuntimeError as error:  # the grid sampler stops the study once its grid is done
            if "Study.stop" not in str(error):
                raise
        if job_dir.is_dir():
            record = {"number": trial.number, "state": state.name, "values": values, "params": trial.params}
            if pruned_at is not None:
                record["pruned_at_step"] = pruned_at
            OmegaConf.save(OmegaConf.create(record), job_dir / "trial.yaml")


def search_space(arguments: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, str]]:
    """The distributions of the sweep overrides among ``arguments`` (``key=interval(...)``,
    ``choice(...)``, ``range(...)``, ``tag(log, ...)``), and the fixed ``key=value`` ones, as Hydra's Optuna
    sweeper reads them."""
    space, fixed = {}, {}
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        if override.is_sweep_override():
            space[key] = _distribution(override)
        else:
            fixed[key] = override.get_value_element_as_str()
    for key in fixed:
        space.pop(key, None)
    return space, fixed


def _distribution(override: Override) -> BaseDistribution:
    value = override.value()
    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if override.is_range_sweep():
        assert isinstance(value, RangeSweep)
        if any(isinstance(v, float) for v in (value.start, value.stop, value.step)):
            return FloatDistribution(value.start, value.stop, step=value.step)
        return IntDistribution(int(value.start), int(value.stop), step=int(value.step))
    if override.is_interval_sweep():
        assert isinstance(value, IntervalSweep)
        ints = isinstance(value.start, int) and isinstance(value.end, int)
        log_scale = "log" in value.tags
        if ints:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    raise ConfigCompositionException(f"{override.input_line}: not a search space distsync_optuna knows")


def _suggest(trial: optuna.Trial, name: str, distribution: BaseDistribution) -> None:
    if isinstance(distribution, CategoricalDistribution):
        trial.suggest_categorical(name, distribution.choices)
    elif isinstance(distribution, IntDistribution):
        step = distribution.step if not distribution.log else 1
        trial.suggest_int(name, distribution.low, distribution.high, step=step, log=distribution.log)
    else:
        low, high = distribution.low, distribution.high
        trial.suggest_float(name, low, high, step=distribution.step, log=distribution.log)


def _grid_choices(name: str, distribution: BaseDistribution) -> list:
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    if isinstance(distribution, (IntDistribution, FloatDistribution)) and distribution.step is not None:
        count = int(round((distribution.high - distribution.low) / distribution.step))
        return [distribution.low + i * distribution.step for i in range(count)]
    raise ConfigCompositionException(f"{name}: the grid sampler needs discrete values (choice or range)")


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


def _values(returned: Any, objectives: int) -> list[float]:
    values = list(returned) if isinstance(returned, (list, tuple)) else [returned]
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


def _finished(study: optuna.Study) -> int:
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(t.state in done and not t.user_attrs.get(_INTERRUPTED) for t in study.trials)


def _fail_interrupted_trials(study: optuna.Study, storage: Any) -> None:
    """Trials left running by a sweep of this host that is gone (killed): failed, and not counted."""
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = str(trial.user_attrs.get(_OWNER, ""))
        owner_host, _, pid = owner.rpartition(":")
        if owner_host == host and pid.isdigit() and not _alive(int(pid)):
            storage.set_trial_user_attr(trial._trial_id, _INTERRUPTED, True)  # noqa: SLF001
            study.tell(trial.number, state=TrialState.FAIL)
            log.info(f"trial #{trial.number} was running when its sweep was killed: failed, not counted")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _trials_table(study: optuna.Study, directions: list[str]) -> str:
    names = sorted({name for t in study.trials for name in t.params})
    header = ["trial", "state", *(f"value ({d})" for d in directions), *names, "job dir"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for t in study.trials:
        state = t.state.name.lower()
        if t.state == TrialState.PRUNED:
            state = f"**pruned** at step {t.last_step}"
        values = t.values or [None] * len(directions)
        cells = [str(t.number), state, *("" if v is None else f"{v:.6g}" for v in values)]
        cells += [str(t.params.get(n, "")) for n in names] + [str(t.user_attrs.get("job_dir", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
