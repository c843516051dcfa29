"""PyTorch-Encoding's model/criterion DataParallel pair: the loss is computed on each device, not gathered.

Balances memory for dense prediction (the outputs never meet on one device). Kept so Encoding code runs by
changing imports; new code should use torchrun + ``DistributedDataParallel`` (see ``docs/migration.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import parallel_apply

from distsync.parallel.replicate import ReplicationCallbackDataParallel

__all__ = ["DataParallelCriterion", "DataParallelModel"]


class DataParallelModel(ReplicationCallbackDataParallel):
    """Data parallelism at the module level whose forward returns the per-device outputs, not gathered.

    Like :class:`ReplicationCallbackDataParallel` (replication callbacks included, so synchronized batch
    norm layers sync across devices) except that the outputs stay on their devices, as a list: pass them
    to :class:`DataParallelCriterion`. On one device, or without CUDA devices, it returns the module's
    output itself, as ``nn.DataParallel`` does.

    Args:
        module: module to be parallelized
        device_ids: CUDA devices. Default: all devices
        output_device: unused, kept for signature compatibility. Default: ``device_ids[0]``
        dim: dimension the inputs are scattered along. Default: 0

    Examples::

        >>> net = DataParallelModel(model, device_ids=[0, 1, 2])
        >>> criterion = DataParallelCriterion(criterion, device_ids=[0, 1, 2])
        >>> y = net(x)
        >>> loss = criterion(y, target)
    """

    def gather(self, outputs, output_device):
        return outputs


def _as_tuple(output: Any) -> tuple:
    return tuple(output) if isinstance(output, (list, tuple)) else (output,)


class DataParallelCriterion(nn.DataParallel):
    """A loss computed on each device from the outputs of :class:`DataParallelModel`; returns their mean.

    The targets are scattered along ``dim`` like the model's inputs were, the criterion is applied on each
    device to that device's output and targets, and the per-device losses are averaged on ``output_device``
    (an unweighted mean, as in PyTorch-Encoding: equal to the whole-batch mean for equal chunks). On one
    device, or without CUDA devices, it is the plain criterion call.

    Args:
        module: the criterion, called as ``module(*output, *targets, **kwargs)``
        device_ids: CUDA devices. Default: all devices
        output_device: device of the returned loss. Default: ``device_ids[0]``
        dim: dimension the targets are scattered along. Default: 0
    """

    def forward(self, inputs, *targets, **kwargs):
        if not self.device_ids:
            return self.module(inputs, *targets, **kwargs)
        targets, kwargs = self.scatter(targets, kwargs, self.device_ids)
        if len(self.device_ids) == 1:
            return self.module(inputs, *targets[0], **kwargs[0])
        count = min(len(inputs), len(targets))
        replicas = self.replicate(self.module, self.device_ids[:count])
        per_device = [(*_as_tuple(output), *target) for output, target in zip(inputs, targets, strict=False)]
        losses = parallel_apply(replicas, per_device[:count], kwargs[:count], self.device_ids[:count])
        device = torch.device(self.src_device_obj.type, self.output_device)
        return sum(loss.to(device) for loss in losses) / len(losses)
