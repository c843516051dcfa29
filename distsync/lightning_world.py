"""A Lightning Trainer inside a torchrun world must run that world, or every rank fits on its own.

Under ``torchrun``, ``distsync.launch`` or ``hydra/launcher=torchrun``, each worker is one rank of a world
of ``WORLD_SIZE``. A Lightning ``Trainer`` adopts that world only when its ``devices`` and ``num_nodes``
match the launcher's ``nproc_per_node`` and ``nnodes``. With ``devices=1`` (the Lightning + Hydra template's
default trainer) it runs a single-device fit on every rank instead: as many independent, unsynchronized
fits as ranks, writing one run directory, with exit code 0. distsync's wheel registers this check with
Lightning (its ``callbacks_factory`` entry points, which Lightning reads for every Trainer): in an elastic
worker it adds a callback that refuses such a fit on every rank before its first step, naming both
settings. Anywhere else the factory adds nothing.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["lightning_callbacks", "pytorch_lightning_callbacks"]


def lightning_callbacks() -> list:
    """``lightning.pytorch.callbacks_factory``: the world-size check in an elastic worker, else nothing."""
    return _callbacks("lightning.pytorch")


def pytorch_lightning_callbacks() -> list:
    """``pytorch_lightning.callbacks_factory``: as :func:`lightning_callbacks`, for the standalone package."""
    return _callbacks("pytorch_lightning")


def _callbacks(package: str) -> list:
    if "TORCHELASTIC_RUN_ID" not in os.environ or "WORLD_SIZE" not in os.environ:
        return []
    callback_class = importlib.import_module(package).Callback

    class WorldSizeCheck(callback_class):
        """Refuses a fit whose Trainer runs another world than the torchrun world of its process."""

        def setup(self, trainer, pl_module, stage: str) -> None:
            launched = int(os.environ["WORLD_SIZE"])
            if trainer.world_size == launched:
                return
            per_node = os.environ.get("LOCAL_WORLD_SIZE", "?")
            raise ValueError(
                f"this process is rank {os.environ.get('RANK', '?')} of a torchrun world of {launched} "
                f"({per_node} per node, nproc_per_node; hydra.launcher.nproc_per_node with distsync's "
                f"launcher), but the Lightning Trainer runs a world of {trainer.world_size} "
                f"(devices={trainer.num_devices}, num_nodes={trainer.num_nodes}): every rank would fit on "
                f"its own. Set the Trainer's devices to {per_node} (and num_nodes to the launcher's nnodes) "
                "with a DDP strategy, or launch one process"
            )

    return [WorldSizeCheck()]
