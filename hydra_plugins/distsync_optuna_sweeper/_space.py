"""The search space of ``hydra/sweeper=distsync_optuna``, read from Hydra's override syntax as Hydra's Optuna
sweeper reads it (``interval``, ``choice``, ``range``, ``tag(log, ...)``), and the trials' values drawn
from it. A space Optuna cannot take (``interval(1,0)``, a log scale from 0) is refused in one line naming
the override, before any trial.
"""

from __future__ import annotations

from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer
from hydra.errors import ConfigCompositionException
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

DIRECTIONS = ("minimize", "maximize")


def directions(direction: Any) -> list[str]:
    """``hydra.sweeper.direction`` as Optuna's directions: one (``minimize``, ``maximize``, Hydra's
    ``Direction`` enum) or a list of them (a list, a tuple, an OmegaConf ``ListConfig``)."""
    several = isinstance(direction, list | tuple) or _is_list_config(direction)
    given = list(direction) if several else [direction]
    names = [str(d).split(".")[-1] for d in given]  # "Direction.minimize": Hydra's enum
    wrong = [name for name in names if name not in DIRECTIONS]
    if wrong or not names:
        raise ConfigCompositionException(
            f"hydra.sweeper.direction must be minimize or maximize, or a list of them (one per objective), "
            f"got {wrong[0] if wrong else direction!r}"
        )
    return names


def _is_list_config(value: Any) -> bool:
    from omegaconf import ListConfig

    return isinstance(value, ListConfig)


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
            return _checked(override, FloatDistribution, value.start, value.stop, step=value.step)
        return _checked(override, IntDistribution, int(value.start), int(value.stop), step=int(value.step))
    if override.is_interval_sweep():
        assert isinstance(value, IntervalSweep)
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return _checked(override, IntDistribution, int(value.start), int(value.end), log=log_scale)
        return _checked(override, FloatDistribution, float(value.start), float(value.end), log=log_scale)
    raise ConfigCompositionException(f"{override.input_line}: not a search space distsync_optuna knows")


def _checked(override: Override, distribution: type, low: Any, high: Any, **options: Any) -> BaseDistribution:
    """``distribution(low, high, **options)``, or one line naming the override that cannot be one."""
    where = override.input_line
    if low > high:
        raise ConfigCompositionException(f"{where}: its low end {low} is above its high end {high}")
    if options.get("log") and low <= 0:
        raise ConfigCompositionException(f"{where}: a log scale needs a low end above 0, got {low}")
    try:
        return distribution(low, high, **options)
    except ValueError as error:  # what Optuna refuses beyond these (a step that does not fit, ...)
        raise ConfigCompositionException(f"{where}: {error}") from None


def suggest(trial: optuna.Trial, name: str, distribution: BaseDistribution) -> None:
    """Draw ``trial``'s value of ``name`` from ``distribution`` (a re-queued trial keeps the value it has)."""
    if isinstance(distribution, CategoricalDistribution):
        trial.suggest_categorical(name, distribution.choices)
    elif isinstance(distribution, IntDistribution):
        step = distribution.step if not distribution.log else 1
        trial.suggest_int(name, distribution.low, distribution.high, step=step, log=distribution.log)
    else:
        low, high = distribution.low, distribution.high
        trial.suggest_float(name, low, high, step=distribution.step, log=distribution.log)


def grid_choices(name: str, distribution: BaseDistribution) -> list:
    """The values of ``name`` the grid sampler walks through."""
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    if isinstance(distribution, IntDistribution | FloatDistribution) and distribution.step is not None:
        count = int(round((distribution.high - distribution.low) / distribution.step))
        return [distribution.low + i * distribution.step for i in range(count)]
    raise ConfigCompositionException(f"{name}: the grid sampler needs discrete values (choice or range)")
