"""``hydra/sweeper=distsync_optuna``: an Optuna study on current Optuna whose trials never wait for a batch.

Up to ``n_jobs`` trials run at once, and a trial starts the moment one of those slots is free, through
Optuna's ask/tell: a long trial holds its slot alone, the others go on. With distsync's launcher
(``hydra/launcher=torchrun``, ``hydra.launcher.n_jobs`` > 1) a slot is a job's GPUs or cores. With Hydra's
submitit launchers (``submitit_slurm``, ``submitit_local``) and other launchers that run jobs out of this
process, a slot is a thread of the sweep that submits one trial's job at a time (each a job of
``hydra.launcher.nodes`` nodes); Hydra's basic launcher runs jobs in this process, so there trials run one
after the other (:mod:`._slots`). A trial whose job ended without a result (a SLURM job cancelled,
preempted, timed out past submitit's requeues, its node failed) is launched again with the same number, so
in its own job directory, where the packaged job resumes from its checkpoint, up to ``max_retries`` (default
2) times; one whose rank 0 had recorded its value or whose pruner had stopped it is told so, not run again.
The study lives in Optuna's own storage (a journal file in the sweep dir by default, or ``storage=``: an RDB
URL or ``journal:<file>``), so a killed sweep resumes with the same ``storage`` and ``study_name``, and a
trial's world reports to it directly: :func:`distsync.report` and :func:`distsync.should_prune` (rank 0 asks
the configured pruner, every rank gets the answer).

Trials that fail are told as failed and the study goes on; at the end the sweep exits non-zero if more than
``max_failure_rate`` of them failed. ``n_trials`` counts the study's trials, every sweep's: a sweep asks for
one while fewer than ``n_trials`` are finished (completed, pruned, failed) or running, and ends only when no
trial of the study runs in another live sweep, so a resumed sweep finishes the study and two sweeps of one
study share the count. Trial #N runs in job directory N. Every sweep writes a heartbeat into the study
(``heartbeat_interval``, ``grace_period``: Optuna's names); the trials of a sweep that stopped (Ctrl-C,
SIGTERM: it cancels the jobs it submitted first) or went silent (SIGKILL, its node lost) are taken over by
the next sweep of the study under their own numbers: told as their worlds recorded, or resumed in their job
directories, waiting first for a job the gone sweep left running (:mod:`._trials`, :mod:`._heartbeat`).
The sweep dir gets ``optimization_results.yaml`` (as Hydra's Optuna sweeper writes it),
``optuna_trials.md`` (every trial: state, values, parameters, job dir; pruned and interrupted ones marked)
and, in each job dir, ``trial.yaml``.

Hydra imports this module on every run of every app (its plugin scan), so it imports no Optuna: the study
(``_study.py``) is imported when the sweeper is chosen, and Optuna older than 4 is refused there by name.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from hydra_plugins.distsync_optuna_sweeper.config import OPTUNA_NEEDED, optuna_major


class DistsyncOptunaSweeper(Sweeper):
    """See the module docstring; the options are :class:`~.config.DistsyncOptunaSweeperConf`'s."""

    def __init__(self, **options: Any) -> None:
        found = optuna_major()
        if found is None or found < OPTUNA_NEEDED:
            have = "is not installed" if found is None else f"{metadata.version('optuna')} is installed"
            raise ImportError(
                f"hydra/sweeper=distsync_optuna needs Optuna {OPTUNA_NEEDED} or newer, and Optuna {have}: "
                "pip install 'distsync[optuna]' (Hydra's own hydra/sweeper=optuna needs Optuna < 3: the two "
                "do not share an environment)"
            )
        from hydra_plugins.distsync_optuna_sweeper._study import AsyncOptunaStudy

        self.study = AsyncOptunaStudy(**options)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.study.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        self.study.sweep(arguments)
