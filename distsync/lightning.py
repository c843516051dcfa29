"""Lightning plugin: ``Trainer(sync_batchnorm=True)`` with distsync instead of ``nn.SyncBatchNorm``.

``nn.SyncBatchNorm`` refuses CPU tensors, so Lightning's own ``sync_batchnorm=True`` fails on CPU/gloo. This
plugin takes its place (it is a ``TorchSyncBatchNorm``, so Lightning accepts it together with the flag)::

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, sync_batchnorm=True,
                      plugins=[DistSyncBatchNormPlugin()])  # or DistSyncBatchNormPlugin(group_size=8)

It serves the unified package's ``lightning.pytorch.Trainer`` and the standalone
``pytorch_lightning.Trainer``, whichever are installed (``pip install "distsync[lightning]"`` brings
``lightning``). See docs/lightning.md.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist
from torch import nn

from distsync import _torch_compat
from distsync.batchnorm import DistSyncBatchNorm
from distsync.convert import convert_sync_batchnorm, revert_sync_batchnorm
from distsync.groups import create_syncbn_process_group

__all__ = ["DistSyncBatchNormPlugin"]


def _layer_sync_bases() -> tuple[type, ...]:
    """Lightning's ``TorchSyncBatchNorm`` of each installed package: its Trainer accepts only its own."""
    bases = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(f"{package}.plugins.layer_sync").TorchSyncBatchNorm)
        except ImportError:
            continue
    if not bases:
        raise ImportError(
            "distsync.lightning needs Lightning: pip install lightning (or pytorch-lightning), "
            'or pip install "distsync[lightning]"'
        )
    return tuple(bases)


class DistSyncBatchNormPlugin(*_layer_sync_bases()):
    """Lightning ``LayerSync`` that swaps batch norm layers for distsync's while fitting, and back after.

    Lightning starts the processes and joins the process group after the ``Trainer`` is built, so a group
    is best given by its size: the plugin creates it with :func:`distsync.create_syncbn_process_group`
    when Lightning applies it, on every rank.

    With groups smaller than the world, each group's running statistics are its own. DDP would overwrite
    them with rank 0's before every forward (``broadcast_buffers``), so the plugin excludes the synced
    layers' buffers from DDP's broadcast; parameters stay synchronized as usual.

    Args:
        group_size: synchronize within groups of this many consecutive ranks (apex's recipe at scale).
            ``0`` or the world size mean the whole world. Default: ``0``
        process_group: an existing group to synchronize over instead (exclusive with ``group_size``).
            Default: ``None`` (the default group)
    """

    def __init__(self, group_size: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
        if group_size and process_group is not None:
            raise ValueError("DistSyncBatchNormPlugin: give group_size or process_group, not both")
        self.group_size = group_size
        self.process_group = process_group
        self._ignored_before: list[str] | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        group = self.process_group
        if group is None and dist.is_initialized():
            group = create_syncbn_process_group(self.group_size)  # every rank: 0 and the world agree
        model = convert_sync_batchnorm(model, process_group=group)
        if group is not None and dist.get_world_size(group) < dist.get_world_size():
            self._keep_group_statistics(model)
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        if self._ignored_before is not None:
            _torch_compat.set_ddp_ignored(model, self._ignored_before)
            self._ignored_before = None
        return revert_sync_batchnorm(model)

    def _keep_group_statistics(self, model: nn.Module) -> None:
        """Exclude the synced layers' buffers from DDP's broadcast of rank 0's buffers."""
        self._ignored_before = _torch_compat.ddp_ignored(model)
        buffers = [
            f"{path}.{name}" if path else name
            for path, layer in model.named_modules()
            if isinstance(layer, DistSyncBatchNorm)
            for name, _ in layer.named_buffers(recurse=False)
        ]
        _torch_compat.set_ddp_ignored(model, [*self._ignored_before, *buffers])
