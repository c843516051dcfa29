"""A run's state in and out of checkpoints: what a resumed attempt loads, and what a checkpoint holds.

Rank 0 decides which checkpoint to resume from (:mod:`distsync.train.resume` says whether the config may
continue it) and every rank loads that one; a checkpoint holds the shared state (model, optimizer, schedule,
data position, step, the time spent) and each rank's own (RNG streams, last losses; under post-local SGD
its model and optimizer, which differ between averagings).
"""

from __future__ import annotations

import dataclasses
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
from distsync.train.resume import ResumeError, check_resume

if TYPE_CHECKING:
    from distsync.train.trainer import Trainer

__all__ = ["resume_training", "save_training_state"]


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
