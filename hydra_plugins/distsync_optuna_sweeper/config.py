"""``hydra/sweeper=distsync_optuna``: its config, and the samplers' and pruners' (``hydra/sweeper/sampler``,
``hydra/sweeper/pruner``).

The keys are those of Hydra's Optuna sweeper (``params`` with ``interval(...)``, ``choice(...)``,
``range(...)``, ``tag(log, ...)``; ``direction``, ``n_trials``, ``n_jobs``, ``sampler``, ``storage``,
``study_name``, ``max_failure_rate``), so a config written for it runs with the one line
``override hydra/sweeper: distsync_optuna``. Added: ``pruner``, ``max_retries``, and Optuna's own
``heartbeat_interval`` and ``grace_period``.
"""

# No ``from __future__ import annotations``: Hydra imports plugins outside ``sys.modules``, where dataclasses
# cannot resolve string annotations (and OmegaConf reads these types: hence ``Optional``).

from dataclasses import dataclass, field
from importlib import metadata, util
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

OPTUNA_NEEDED = (
    4  # the oldest major release of Optuna the sweeper runs on (JournalStorage, FloatDistribution)
)


def optuna_major() -> Optional[int]:  # noqa: UP045
    """The installed Optuna's major version (None: not installed); reads metadata, imports nothing."""
    try:
        return int(metadata.version("optuna").split(".")[0])
    except metadata.PackageNotFoundError:
        return None


def hydras_sweeper_owns_the_samplers() -> bool:
    """Hydra's own Optuna sweeper stores ``hydra/sweeper/sampler`` entries too, for the Optuna < 3 it needs.
    Where it is installed with that Optuna, its entries stay (ours, written for Optuna 4, would break it; and
    distsync_optuna refuses to run there anyway, naming the Optuna it needs)."""
    found = optuna_major()
    return (
        found is not None
        and found < OPTUNA_NEEDED
        and util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
    )


@dataclass
class DistsyncOptunaSweeperConf:
    """An Optuna study whose trials start as soon as a slot of the launcher is free (asynchronous)."""

    _target_: str = "hydra_plugins.distsync_optuna_sweeper.sweeper.DistsyncOptunaSweeper"
    _recursive_: bool = False  # the sweeper builds its sampler and pruner itself, without unset arguments
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "nop"}])
    sampler: Any = MISSING
    pruner: Any = MISSING
    direction: Any = "minimize"  # or "maximize", or a list of them for several objectives
    storage: Optional[str] = None  # noqa: UP045  an RDB URL, or journal:<file>; default: the sweep dir's
    study_name: Optional[str] = None  # noqa: UP045
    n_trials: int = 20  # the study's trials, every sweep's: asked while fewer are finished or running
    n_jobs: int = 2  # trials running at once, each on a slot of the launcher (hydra.launcher.n_jobs)
    max_failure_rate: float = 0.0  # above this share of failed trials, the sweep exits non-zero at its end
    max_retries: int = 2  # a trial whose job ended without a result (cancelled, preempted) is launched again
    # Optuna's names: a sweep writes its heartbeat into the study every heartbeat_interval seconds; the trials
    # of a sweep silent for grace_period (default: twice that) are taken over by the next sweep of the study
    heartbeat_interval: float = 30.0
    grace_period: Optional[float] = None  # noqa: UP045
    params: Optional[dict[str, str]] = None  # noqa: UP045
    custom_search_space: Optional[str] = None  # noqa: UP045  (Hydra's: not supported, refused)


# Samplers and pruners: ``_target_`` and the arguments users set; unset (None) ones are not passed, so
# Optuna's own defaults apply, whatever its release.
@dataclass
class TPESamplerConf:
    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None  # noqa: UP045
    consider_prior: Optional[bool] = None  # noqa: UP045
    prior_weight: Optional[float] = None  # noqa: UP045
    consider_magic_clip: Optional[bool] = None  # noqa: UP045
    consider_endpoints: Optional[bool] = None  # noqa: UP045
    n_startup_trials: Optional[int] = None  # noqa: UP045
    n_ei_candidates: Optional[int] = None  # noqa: UP045
    multivariate: Optional[bool] = None  # noqa: UP045
    warn_independent_sampling: Optional[bool] = None  # noqa: UP045
    constant_liar: bool = True  # trials run at once: do not propose the same point to each


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None  # noqa: UP045


@dataclass
class CmaEsSamplerConf:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: Optional[int] = None  # noqa: UP045
    x0: Optional[dict[str, Any]] = None  # noqa: UP045
    sigma0: Optional[float] = None  # noqa: UP045
    n_startup_trials: Optional[int] = None  # noqa: UP045
    warn_independent_sampling: Optional[bool] = None  # noqa: UP045
    consider_pruned_trials: Optional[bool] = None  # noqa: UP045
    restart_strategy: Optional[Any] = None  # noqa: UP045
    inc_popsize: Optional[int] = None  # noqa: UP045
    use_separable_cma: Optional[bool] = None  # noqa: UP045


@dataclass
class NSGAIISamplerConf:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: Optional[int] = None  # noqa: UP045
    population_size: Optional[int] = None  # noqa: UP045
    mutation_prob: Optional[float] = None  # noqa: UP045
    crossover_prob: Optional[float] = None  # noqa: UP045
    swapping_prob: Optional[float] = None  # noqa: UP045


@dataclass
class QMCSamplerConf:
    _target_: str = "optuna.samplers.QMCSampler"
    seed: Optional[int] = None  # noqa: UP045
    qmc_type: Optional[str] = None  # noqa: UP045
    scramble: Optional[bool] = None  # noqa: UP045


@dataclass
class GridSamplerConf:
    """The grid of ``params`` (discrete distributions only), as Hydra's Optuna sweeper builds it."""

    _target_: str = "optuna.samplers.GridSampler"
    seed: Optional[int] = None  # noqa: UP045


@dataclass
class NopPrunerConf:
    _target_: str = "optuna.pruners.NopPruner"


@dataclass
class MedianPrunerConf:
    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: Optional[int] = None  # noqa: UP045
    n_warmup_steps: Optional[int] = None  # noqa: UP045
    interval_steps: Optional[int] = None  # noqa: UP045
    n_min_trials: Optional[int] = None  # noqa: UP045


@dataclass
class PercentilePrunerConf:
    _target_: str = "optuna.pruners.PercentilePruner"
    percentile: float = 25.0
    n_startup_trials: Optional[int] = None  # noqa: UP045
    n_warmup_steps: Optional[int] = None  # noqa: UP045
    interval_steps: Optional[int] = None  # noqa: UP045


@dataclass
class ThresholdPrunerConf:
    _target_: str = "optuna.pruners.ThresholdPruner"
    lower: Optional[float] = None  # noqa: UP045
    upper: Optional[float] = None  # noqa: UP045
    n_warmup_steps: Optional[int] = None  # noqa: UP045
    interval_steps: Optional[int] = None  # noqa: UP045


@dataclass
class SuccessiveHalvingPrunerConf:
    """Asynchronous successive halving (ASHA): the pruner for trials that run at once."""

    _target_: str = "optuna.pruners.SuccessiveHalvingPruner"
    min_resource: Optional[Any] = None  # noqa: UP045
    reduction_factor: Optional[int] = None  # noqa: UP045
    min_early_stopping_rate: Optional[int] = None  # noqa: UP045


@dataclass
class HyperbandPrunerConf:
    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: Optional[int] = None  # noqa: UP045
    max_resource: Optional[Any] = None  # noqa: UP045
    reduction_factor: Optional[int] = None  # noqa: UP045


_store = ConfigStore.instance()
_store.store(
    group="hydra/sweeper", name="distsync_optuna", node=DistsyncOptunaSweeperConf, provider="distsync"
)
SAMPLERS = {
    "tpe": TPESamplerConf,
    "motpe": TPESamplerConf,  # Optuna 4 folded MOTPE into TPE (several objectives)
    "random": RandomSamplerConf,
    "cmaes": CmaEsSamplerConf,
    "nsgaii": NSGAIISamplerConf,
    "qmc": QMCSamplerConf,
    "grid": GridSamplerConf,
}
for _name, _node in () if hydras_sweeper_owns_the_samplers() else SAMPLERS.items():
    _store.store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="distsync")
for _name, _node in {
    "nop": NopPrunerConf,
    "median": MedianPrunerConf,
    "percentile": PercentilePrunerConf,
    "threshold": ThresholdPrunerConf,
    "successive_halving": SuccessiveHalvingPrunerConf,
    "hyperband": HyperbandPrunerConf,
}.items():
    _store.store(group="hydra/sweeper/pruner", name=_name, node=_node, provider="distsync")
