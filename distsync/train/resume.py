"""Which configuration changes a run directory can be resumed with.

A checkpoint stores the config of the run that wrote it. Resuming with another config either continues the
same run with different bookkeeping (allowed) or silently turns it into a different run, or fails deep in
``load_state_dict`` with a size mismatch (refused here, with one line naming every changed key):

* **Allowed, silently:** the keys of :data:`OPERATIONAL` (logging, evaluation and checkpoint intervals,
  restarts, timeouts, rendezvous, progress bar, the metric returned to Hydra) and the world size
  (``trainer.nproc_per_node``/``nnodes``; the worker warns that the RNG streams are reseeded).
* **``trainer.max_steps``:** allowed with ``optim.schedule=constant`` (the learning rate of every step does
  not depend on it, so a longer run continues exactly as if it had been asked for from the start),
  refused with ``cosine`` (the decay to zero at ``max_steps`` already followed would be bent), and
  refused when the checkpoint is already past the new value.
* **Refused:** everything else (model, data, optimizer, seed, communication options), including keys that
  a future version adds, until they are listed here.
"""

from __future__ import annotations

from collections.abc import Mapping

from distsync.train.config import ConfigError

__all__ = ["ResumeError", "OPERATIONAL", "config_changes", "check_resume"]

OPERATIONAL = frozenset(
    {
        "trainer.nproc_per_node",
        "trainer.nnodes",
        "trainer.max_restarts",
        "trainer.checkpoint_every",
        "trainer.keep_checkpoints",
        "trainer.log_every",
        "trainer.eval_every",
        "trainer.precise_bn_batches",  # recomputes BN statistics before evaluations: the training is the same
        "trainer.backend",
        "trainer.timeout_s",
        "trainer.metric",
        "trainer.progress",
        "trainer.monitor_interval",
        "trainer.rdzv_endpoint",
        "trainer.rdzv_id",
    }
)
"""Dotted keys that do not change what is trained; they may differ between a checkpoint and its resume."""


class ResumeError(ConfigError):
    """The run directory holds a checkpoint of a run that the current config would not continue."""


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_MISSING = "<unset>"


def config_changes(saved: Mapping, current: Mapping) -> dict[str, tuple[object, object]]:
    """Every dotted key whose value differs between two config trees, as ``{key: (saved, current)}``."""
    old, new = _flatten(saved), _flatten(current)
    return {
        key: (old.get(key, _MISSING), new.get(key, _MISSING))
        for key in sorted(old.keys() | new.keys())
        if old.get(key, _MISSING) != new.get(key, _MISSING)
    }


def check_resume(saved: Mapping, current: Mapping, step: int, where: str = "the checkpoint") -> list[str]:
    """Raise :class:`ResumeError` if ``current`` may not continue the run ``saved`` checkpointed at ``step``.

    Args:
        saved: the config tree stored in the checkpoint (``dataclasses.asdict`` of a ``TrainConfig``)
        current: the config tree of this attempt
        step: the checkpoint's step
        where: the checkpoint's name, for the message

    Returns:
        the allowed changes, one ``"key: old -> new"`` string each, for the log
    """
    changes = config_changes(saved, current)
    refused = {k: v for k, v in changes.items() if k not in OPERATIONAL and k != "trainer.max_steps"}
    why = "the checkpointed run was trained with the old values"
    if "trainer.max_steps" in changes:
        new_max = changes["trainer.max_steps"][1]
        schedule = _flatten(current).get("optim.schedule")
        if not isinstance(new_max, int) or step > new_max:
            max_steps_why = f"the checkpoint is at step {step}, past trainer.max_steps={new_max}"
        elif schedule != "constant":
            max_steps_why = f"optim.schedule={schedule} spreads the learning rate over trainer.max_steps"
        else:
            max_steps_why = None
        if max_steps_why:
            why = why if refused else max_steps_why
            refused["trainer.max_steps"] = changes["trainer.max_steps"]
    if refused:
        listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise ResumeError(
            f"{listed}: cannot resume the run checkpointed in {where} at step {step}: {why}; "
            "restore the old values or use a new run directory (hydra.run.dir=...)"
        )
    return [f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()]
