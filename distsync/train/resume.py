"""Which configuration changes a run directory can be resumed with, and the resume itself.

A checkpoint stores the config of the run that wrote it. The keys of :data:`OPERATIONAL` and the world size
may change; ``trainer.max_steps`` may with ``optim.schedule=constant`` (and not below the checkpoint's
step); every other change is refused in one line naming each key (docs/training.md, "Changed
configuration"). Rank 0 picks the checkpoint and every rank loads it (:func:`resume_training`); it holds
the shared state and each rank's own (RNG streams, last losses; under post-local SGD its model and
optimizer): :func:`save_training_state`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from distsync.train.checkpoint import (
    load_checkpoint,
    load_newest_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from distsync.train.collectives import broadcast_object, gather_object
from distsync.train.config import ConfigError

if TYPE_CHECKING:
    from distsync.train.trainer import Trainer

__all__ = [
    "ResumeError",
    "OPERATIONAL",
    "config_changes",
    "check_resume",
    "resume_training",
    "save_training_state",
]

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


def resume_training(trainer: Trainer) -> dict | None:
    """Load the run directory's newest usable checkpoint into ``trainer`` (rank 0 chooses, every rank
    loads the same one); refuse, on every rank, a checkpoint the config may not continue.

    Returns this rank's own model and optimizer state when the checkpoint holds one per rank
    (post-local-SGD, where the ranks' models differ between averagings), for after the DDP wrap.
    """
    path, error, allowed = None, None, []
    if trainer.rank == 0:
        found = load_newest_checkpoint(trainer.run_dir, trainer.log)
        if found is not None:
            path, state = found
            try:
                allowed = check_resume(
                    state["config"], dataclasses.asdict(trainer.cfg), state["step"], str(path)
                )
            except ResumeError as refused:
                error = str(refused)
                trainer.log.error("%s", error)
            if allowed:
                trainer.log.info("resuming with changed settings: %s", ", ".join(allowed))
    path, error = broadcast_object((str(path) if path else None, error))
    if error:
        raise ResumeError(error)
    if path is None:
        trainer.metrics.truncate(0)  # rows of an earlier attempt that never checkpointed
        return None
    if trainer.rank != 0:
        state = load_checkpoint(path)
    local = state.get("local")
    same_world = len(state["rng"]) == trainer.world_size
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(
        local[trainer.rank]["optimizer"] if local and same_world else state["optimizer"]
    )
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.batches.load_state_dict(state["batches"])
    if same_world:
        set_rng_state(state["rng"][trainer.rank])
    else:
        trainer.log.warning(
            "checkpoint from %d ranks, now %d: RNG reseeded", len(state["rng"]), trainer.world_size
        )
    trainer.step = trainer.resumed_from = int(state["step"])
    if "recent_losses" in state:  # older checkpoints: final_loss from the steps run after resuming
        recent = torch.tensor(state["recent_losses"], dtype=torch.float64)
        trainer.recent_losses.copy_(recent[trainer.rank] if same_world else recent.mean(0))
    # The time the run was down between its last checkpoint and this attempt does not count (nor the
    # steps after that checkpoint that were lost: they are run again). Older checkpoints: since the start.
    trainer.seconds_before = state.get("trained_seconds", trainer.started - state["started_at"])
    trainer.metrics.truncate(trainer.step)
    trainer.log.info("resumed from %s (step %d, restart %d)", path, trainer.step, trainer.restarts)
    return local[trainer.rank] if local and same_world else None


def save_training_state(trainer: Trainer) -> None:
    """Checkpoint ``trainer``'s state at its step: rank 0 writes every rank's RNG streams and last losses
    (and, under post-local SGD, every rank's model and optimizer) with the shared state."""
    mine = {"rng": rng_state(), "recent_losses": trainer.recent_losses.tolist()}
    if trainer.comm.local_sgd:  # the ranks' models and optimizers differ between averagings
        mine.update(model=trainer.model.state_dict(), optimizer=trainer.optimizer.state_dict())
    ranks = gather_object(mine)
    if trainer.rank != 0:
        return
    state = {
        "step": trainer.step,
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "batches": trainer.batches.state_dict(),
        "rng": [r.pop("rng") for r in ranks],
        "local": ranks if trainer.comm.local_sgd else None,
        "recent_losses": [r.pop("recent_losses") for r in ranks],
        "started_at": trainer.started - trainer.seconds_before,
        "trained_seconds": trainer.seconds_spent(),
        "world_size": trainer.world_size,
        "config": dataclasses.asdict(trainer.cfg),
    }
    path = save_checkpoint(trainer.run_dir, trainer.step, state, keep=trainer.cfg.trainer.keep_checkpoints)
    trainer.log.info("checkpoint %s", path)
