"""``_target_`` nodes: the config names any importable factory, with its keyword arguments.

A node is a plain dict such as ``{"_target_": "torchvision.models.resnet18", "num_classes": 10}``, built by
``hydra.utils.instantiate`` (nested nodes, a ``Compose`` of transforms, first). What Hydra does not do is
check a node before it is called: before any worker starts, :func:`check_node` imports every target and
checks every key against its signature, so a misspelled argument costs one line, not a world of failed
workers.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from distsync.train.config import ConfigError

__all__ = ["TARGET", "is_node", "import_target", "check_node", "check_targets", "instantiate"]

TARGET = "_target_"


def is_node(value: Any) -> bool:
    return isinstance(value, dict) and TARGET in value


def import_target(path: str, key: str = "_target_") -> Callable:
    """The callable named by the dotted ``path``; :class:`ConfigError` naming ``key`` if it cannot be had."""
    parts = str(path).split(".")
    error: Exception = ValueError("not a dotted path")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
        module = ".".join(parts[:split])
        try:
            target = importlib.import_module(module)
        except ModuleNotFoundError as caught:
            if caught.name and module.startswith(caught.name):  # not there: try a shorter module path
                error = caught
                continue
            raise ConfigError(f"{key}: importing {module} for {path!r} failed: {_cause(caught)}") from caught
        except Exception as caught:  # the module exists but fails to import (a broken install, say)
            raise ConfigError(f"{key}: importing {module} for {path!r} failed: {_cause(caught)}") from caught
        try:
            for part in parts[split:]:
                target = getattr(target, part)
        except AttributeError as caught:
            error = caught
            break
        if callable(target):
            return target
        error = TypeError("not callable")
        break
    raise ConfigError(f"{key}: cannot import {path!r} ({error})")


def _cause(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def check_node(node: dict, key: str, positional: int = 0) -> None:
    """Import ``node``'s target and check its keys against the target's signature, nested nodes too.

    ``positional`` leading parameters are supplied by the job (an optimizer's ``params``), not the config.
    """
    target = import_target(node[TARGET], f"{key}._target_")
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        parameters = None
    if parameters is not None:
        names = {p.name for p in parameters[positional:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        open_ended = any(p.kind == p.VAR_KEYWORD for p in parameters)
        for name in node:
            if name != TARGET and name not in names and not open_ended:
                known = ", ".join(sorted(names))
                raise ConfigError(f"{key}.{name}: not a parameter of {node[TARGET]} (it takes: {known})")
    for name, value in node.items():
        _check_nested(value, f"{key}.{name}")


def _check_nested(value: Any, key: str) -> None:
    if is_node(value):
        check_node(value, key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_nested(item, f"{key}.{i}")
    elif isinstance(value, dict):
        for name, item in value.items():
            _check_nested(item, f"{key}.{name}")


def instantiate(node: dict, *args: Any, **overrides: Any) -> Any:
    """Call ``node``'s target with ``*args`` and its keys (nested nodes built first), ``overrides`` last:
    ``hydra.utils.instantiate`` with plain lists and dicts, raising what the target raised (not Hydra's
    wrapper), so that every rank's error message names the cause."""
    from hydra.errors import InstantiationException  # lazy: the checks above need no Hydra
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(node, *args, _convert_="all", **overrides)
    except InstantiationException as error:
        raise (error.__cause__ or error) from None


def check_targets(cfg) -> None:
    """Check every ``_target_`` node of a :class:`~distsync.train.config.TrainConfig` (:func:`check_node`)."""
    nodes = [
        (cfg.model.factory, "model.factory", 0),
        (cfg.model.loss, "model.loss", 0),
        (cfg.data.train, "data.train", 0),
        (cfg.data.test, "data.test", 0),
        (cfg.optim.factory, "optim.factory", 1),  # the model's parameters come first
        (cfg.optim.scheduler, "optim.scheduler", 1),  # the optimizer comes first
    ]
    for node, key, positional in nodes:
        if node:
            check_node(node, key, positional)
    if cfg.data.train:
        from distsync.train.streaming import (  # lazy: streaming imports the trainer's modules
            check_streaming,
            is_stream,
        )

        if is_stream(import_target(cfg.data.train[TARGET])):  # a dataset class; a factory is checked later
            check_streaming(cfg)
