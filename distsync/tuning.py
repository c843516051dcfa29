"""The Optuna trial a world runs for ``hydra/sweeper=distsync_optuna``: intermediate values and pruning.

The sweeper gives each trial's job four environment variables (through Hydra's ``hydra.job.env_set``,
which :func:`distsync.launch` hands every rank): the study's storage, its name, the trial and the study's
pruner (which lives in the sweeper, not in the storage). In that world
:func:`report` sends an intermediate value to the study (from rank 0) and :func:`should_prune` asks the
study's pruner (on rank 0) and gives every rank of the world its answer, so all of them stop together.
Outside such a sweep both do nothing (``should_prune()`` is False), so a task can call them always.

A pruned trial's rank 0 records the step in the trial (a user attribute); the sweeper then tells the study
the trial was pruned, whatever the task returned after stopping. :func:`report_result` records the trial's
final value the same way, as soon as it is known (``distsync.launch`` does it with rank 0's return value),
so that a sweep killed before its world ended still counts the trial as finished when it resumes.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["report", "report_result", "should_prune"]

STORAGE, STUDY, TRIAL = "DISTSYNC_OPTUNA_STORAGE", "DISTSYNC_OPTUNA_STUDY", "DISTSYNC_OPTUNA_TRIAL"
PRUNER = "DISTSYNC_OPTUNA_PRUNER"  # the study's pruner: JSON of its class path and arguments
PRUNED_AT = "distsync_pruned_at"  # user attribute: the step at which the trial was pruned
RESULT = "distsync_result"  # user attribute: the trial's final value(s), as a list of floats

_last_step: list[int | None] = [None]


def report(step: int, value: float) -> None:
    """Report ``value`` at ``step`` (an epoch, an evaluation) to the trial's study, from rank 0; a no-op
    outside a ``distsync_optuna`` sweep, on the other ranks, and in a study of several objectives (which
    Optuna does not prune). Call it on every rank alike."""
    _last_step[0] = int(step)
    trial = _trial()
    if trial is not None and _rank() == 0 and _prunable(trial):
        trial.report(float(value), int(step))


def should_prune() -> bool:
    """Whether the study's pruner stops this trial now, the same answer on every rank of the world (decided
    on rank 0 from the values :func:`report` sent; one all-reduce of the default group when it has several
    ranks). False outside a ``distsync_optuna`` sweep and in a study of several objectives. Call it on every
    rank alike, after :func:`report`."""
    trial = _trial()
    if trial is None:
        return False
    prune = bool(trial.should_prune()) if _rank() == 0 and _prunable(trial) else False
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        flag = torch.tensor([float(prune)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        prune = bool(flag.item())
    if prune and _rank() == 0:
        trial.set_user_attr(PRUNED_AT, _last_step[0])
    return prune


def report_result(value: Any) -> None:
    """Record ``value``, this trial's final value (a float, or a list of them for several objectives), in
    the trial, from rank 0; a no-op outside a ``distsync_optuna`` sweep, on the other ranks, and for a value
    that is not float-castable. The sweeper tells the study the value its job returns; this record counts
    only when the sweep was killed before it could: resumed, it tells the trial finished with it.
    :func:`distsync.launch` calls it with rank 0's return value; call it yourself where the value is known
    well before the task returns (a long teardown after it). Failing to record it (the study's storage
    unreachable) fails nothing: it says so on stderr, and the sweeper still tells the study the value the
    job returns."""
    try:
        values = [float(v) for v in (value if isinstance(value, list | tuple) else [value])]
    except (TypeError, ValueError):
        return  # the sweeper says what is wrong with it when the job returns it
    try:
        trial = _trial()
        if trial is not None and _rank() == 0:
            trial.set_user_attr(RESULT, values)
    except Exception as error:
        print(f"distsync: could not record the trial's result in its study: {error!r}", file=sys.stderr)


def _prunable(trial: Any) -> bool:
    """Optuna reports intermediate values and prunes in studies of one objective only."""
    return len(trial.study.directions) == 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _trial() -> Any:
    key = (os.environ.get(STORAGE), os.environ.get(STUDY), os.environ.get(TRIAL), os.environ.get(PRUNER, ""))
    if None in key:
        return None
    return _open_trial(*key)


@functools.cache
def _open_trial(url: str, study_name: str, trial_id: str, pruner: str) -> Any:
    import optuna

    study = optuna.load_study(study_name=study_name, storage=storage_from_url(url), pruner=_pruner(pruner))
    return optuna.trial.Trial(study, int(trial_id))  # the asked trial, by its storage id


def _pruner(spec: str) -> Any:
    """The pruner described by ``spec`` (``{"_target_": "optuna.pruners.MedianPruner", ...}``), or None."""
    if not spec:
        return None
    arguments = json.loads(spec)
    module, _, name = arguments.pop("_target_").rpartition(".")
    return getattr(importlib.import_module(module), name)(**arguments)


def storage_from_url(url: str) -> Any:
    """An Optuna storage from a URL: ``journal:<file>`` (a journal file, which processes of several hosts
    may share on a common filesystem) or an RDB URL (``sqlite:///...``, ``postgresql://...``)."""
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:") :]))
    return optuna.storages.RDBStorage(url)


def job_overrides(url: str, study_name: str, trial_id: int, pruner: dict[str, Any]) -> list[str]:
    """The Hydra overrides that give a trial's job the environment above (``hydra.job.env_set``)."""
    values = {STORAGE: url, STUDY: study_name, TRIAL: str(trial_id), PRUNER: json.dumps(pruner)}
    return [f"+hydra.job.env_set.{key}={_quoted(value)}" for key, value in values.items()]


def _quoted(value: str) -> str:
    """``value`` as a quoted string of Hydra's override grammar."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
