"""How DDP communicates gradients: compression hooks, PowerSGD, post-local-SGD with model averaging.

DDP already overlaps the gradient all-reduce with the backward pass (the "non-blocking" update). On top,
``trainer.comm_hook`` compresses what is sent (``fp16``/``bf16`` casts, ``powersgd`` low-rank factors),
and ``trainer.local_sgd_period > 0`` switches to post-local-SGD after ``trainer.local_sgd_warmup`` steps:
every rank steps on its own gradients and the models are averaged every ``local_sgd_period`` steps
(hierarchical, infrequent global synchronization). Batch-norm statistics stay synchronized in every
forward either way when ``model.norm=sync``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distsync.train.config import TrainerConfig

__all__ = ["CommSetup"]


class CommSetup:
    """Builds the optimizer wrapper and the DDP comm hook that ``trainer`` asks for.

    Args:
        trainer: the trainer config (``comm_hook``, ``powersgd_rank``, ``local_sgd_period``,
            ``local_sgd_warmup``)
        world_size: number of ranks; with one rank nothing is communicated and nothing is set up
    """

    def __init__(self, trainer: TrainerConfig, world_size: int) -> None:
        self.trainer = trainer
        self.active = world_size > 1 and dist.is_initialized()
        self.hook_state = None

    @property
    def local_sgd(self) -> bool:
        return self.active and self.trainer.local_sgd_period > 0

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer``, or a ``PostLocalSGDOptimizer`` that averages the models periodically."""
        if not self.local_sgd:
            return optimizer
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        averager = PeriodicModelAverager(
            period=self.trainer.local_sgd_period, warmup_steps=self.trainer.local_sgd_warmup
        )
        return _resumable_post_local_sgd(optimizer, averager)

    def register_hook(self, ddp: DistributedDataParallel, step: int) -> None:
        """Register the comm hook on ``ddp``; ``step`` (non-zero after a resume) restores the hook's clock."""
        if not self.active:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import (
            default_hooks,
            post_localSGD_hook,
            powerSGD_hook,
        )

        t = self.trainer
        if self.local_sgd:
            # Subgroups of one rank: gradients stay local after the warm-up, models are averaged globally.
            subgroup, _ = dist.new_subgroups(group_size=1)
            self.hook_state = post_localSGD_hook.PostLocalSGDState(
                process_group=None, subgroup=subgroup, start_localSGD_iter=t.local_sgd_warmup
            )
            self.hook_state.iter = step
            ddp.register_comm_hook(self.hook_state, post_localSGD_hook.post_localSGD_hook)
        elif t.comm_hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif t.comm_hook == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif t.comm_hook == "powersgd":
            self.hook_state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=t.powersgd_rank, start_powerSGD_iter=2
            )
            self.hook_state.iter = step
            ddp.register_comm_hook(self.hook_state, powerSGD_hook.powerSGD_hook)


def _resumable_post_local_sgd(optimizer: torch.optim.Optimizer, averager) -> torch.optim.Optimizer:
    """A ``PostLocalSGDOptimizer`` whose ``param_groups`` stay the wrapped optimizer's after a resume.

    ``PostLocalSGDOptimizer`` copies ``optim.param_groups`` once in its constructor, but
    ``Optimizer.load_state_dict`` replaces that list: after loading a checkpoint, an LR scheduler would
    set the learning rate on the stale groups while the optimizer kept stepping with the checkpoint's.
    """
    from torch.distributed.optim import PostLocalSGDOptimizer

    class ResumablePostLocalSGDOptimizer(PostLocalSGDOptimizer):
        def load_state_dict(self, state_dict: dict) -> None:
            super().load_state_dict(state_dict)
            self.param_groups = self.optim.param_groups

    return ResumablePostLocalSGDOptimizer(optim=optimizer, averager=averager)
