"""``_target_`` nodes: the config names any importable factory, with its keyword arguments."""

from __future__ import annotations

from typing import Any

__all__ = ["instantiate"]


def instantiate(node: dict, *args: Any, **overrides: Any) -> Any:
    """``hydra.utils.instantiate(node, *args, **overrides)`` with plain lists and dicts for the target,
    raising what the target (or the import of it) raised rather than Hydra's wrapper, so that every rank's
    error message names the cause."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(node, *args, _convert_="all", **overrides)
    except InstantiationException as error:
        raise (error.__cause__ or error) from None
