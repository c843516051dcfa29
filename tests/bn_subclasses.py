"""Batch-norm subclasses written as model libraries write them (module level: spawned ranks import them)."""

import torch
import torch.nn.functional as F
from torch import nn


class ActNorm2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d pattern: its own F.batch_norm call, then dropout and an activation held in
    children, plus a buffer and a parameter of its own."""

    def __init__(self, num_features, momentum=0.1, **kwargs):
        super().__init__(num_features, momentum=momentum, **kwargs)
        self.act = nn.SiLU()
        self.drop = nn.Identity()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.gain = nn.Parameter(torch.full((num_features,), 1.5))

    def forward(self, x):
        if x.dim() != 4:
            raise ValueError(f"ActNorm2d expects 4D input, got {x.dim()}D")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            self.calls.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        training = self.training or self.running_mean is None
        x = F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            training,
            factor,
            self.eps,
        )
        return self.act(self.drop(x)) * self.gain.view(1, -1, 1, 1)


class SuperNorm1d(nn.BatchNorm1d):
    """The base class's forward, then an activation: the other common pattern."""

    def forward(self, x):
        return torch.tanh(super().forward(x)) + 0.5


class SyncNormAct(nn.SyncBatchNorm):
    """timm's SyncBatchNormAct pattern: nn.SyncBatchNorm's forward, then an activation."""

    def forward(self, x):
        return F.relu(super().forward(x))


class AtenNorm(nn.BatchNorm2d):
    """Calls torch.batch_norm (the ATen op) directly."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        out = torch.batch_norm(
            x,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.training,
            0.1,
            self.eps,
            False,
        )
        return out.abs()


class OwnStatisticsNorm(nn.BatchNorm2d):
    """Computes its statistics itself: nothing a sync could route, so it must be refused."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        mean = x.mean((0, 2, 3), keepdim=True)
        var = x.var((0, 2, 3), unbiased=False, keepdim=True)
        return (x - mean) * (var + self.eps).rsqrt()


class SkipsEmptyNorm(nn.BatchNorm2d):
    """Returns an empty batch as it is, without F.batch_norm: a rank with no samples makes no call."""

    def forward(self, x):
        if x.shape[0] == 0:
            return x
        return super().forward(x)


class ReluNorm2d(nn.BatchNorm2d):
    """Traceable by torch.fx, as timm's BatchNormAct2d: its own F.batch_norm call, then a ReLU."""

    def forward(self, x):
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        training = self.training or not self.track_running_stats
        x = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, training, self.momentum, self.eps
        )
        return F.relu(x)


class DualNorm2d(nn.BatchNorm2d):
    """AdvProp's batch norm: a second set of running statistics, with a counter of its own, for an auxiliary
    domain (``aux``): its own buffers passed to F.batch_norm."""

    def __init__(self, num_features, **kwargs):
        super().__init__(num_features, **kwargs)
        self.register_buffer("aux_mean", torch.zeros(num_features))
        self.register_buffer("aux_var", torch.ones(num_features))
        self.register_buffer("aux_batches", torch.zeros((), dtype=torch.long))
        self.aux = False

    def forward(self, x):
        if self.aux:
            mean, var, counted = self.aux_mean, self.aux_var, self.aux_batches
        else:
            mean, var, counted = self.running_mean, self.running_var, self.num_batches_tracked
        if self.training:
            counted.add_(1)
        return F.batch_norm(x, mean, var, self.weight, self.bias, self.training, self.momentum, self.eps)


class UncountedNorm2d(nn.BatchNorm2d):
    """F.batch_norm with the layer's statistics and momentum, never counting num_batches_tracked."""

    def forward(self, x):
        return F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )
