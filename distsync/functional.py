"""Synchronized batch normalization as an autograd Function: one all-reduce forward, one backward."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _moments
from ._moments import BACKWARD, FORWARD, CallTag
from ._transport import Reducer


class SyncCounter:
    """Identity of one synchronized layer and how often each direction has synced (for desync checks)."""

    def __init__(self, layer_id: int, layer_name: str) -> None:
        self.layer_id = layer_id
        self.layer_name = layer_name
        self.calls = [0, 0]

    def next_tag(self, direction: int) -> CallTag:
        call = self.calls[direction]
        self.calls[direction] = call + 1
        return CallTag(self.layer_id, direction, call, self.layer_name)

    def fresh_copy(self) -> SyncCounter:
        """Same identity, own counts (for a replica that syncs independently of the original)."""
        copy = SyncCounter(self.layer_id, self.layer_name)
        copy.calls = list(self.calls)
        return copy


def _update_running_stats(
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    mean: Tensor,
    unbiased_var: Tensor,
) -> None:
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if momentum is None:  # cumulative moving average
        factor = num_batches_tracked.double().reciprocal().to(running_mean.dtype)
    else:
        factor = momentum
    dtype = running_mean.dtype
    torch._foreach_lerp_([running_mean, running_var], [mean.to(dtype), unbiased_var.to(dtype)], factor)


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm whose statistics are those of the union of all participants' batches.

    Forward reduces per-channel count, ``sum(x)`` and ``sum(x^2)`` (float64, from shifted inputs so
    nothing cancels); backward reduces ``sum(dy)`` and ``sum(dy * x_hat)``. Weight and bias gradients
    stay local, like ``nn.SyncBatchNorm``: DistributedDataParallel averages them.
    """

    @staticmethod
    def forward(
        ctx,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        num_batches_tracked: Tensor | None,
        momentum: float | None,
        eps: float,
        num_features: int,
        reducer: Reducer,
        counter: SyncCounter,
        problem: str | None,
    ) -> Tensor:
        tag = counter.next_tag(FORWARD)
        payload, local = _moments.forward_payload(None if problem else input, num_features, input.device, tag)
        reducer.all_reduce(payload)
        count, sums = _moments.unpack(payload, reducer.world_size, tag, problem)
        if count <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {count} over all ranks "
                f"(input size on this rank {list(input.shape)}) at {tag.describe()}"
            )
        mean, var = _moments.merge_moments(count, sums)
        update_running = running_mean is not None and running_var is not None
        # The input was shifted per channel (see LocalMoments): normalize it with the mean shifted alike.
        rows = (
            [mean - local.shift, var, mean, var * (count / (count - 1))]
            if update_running
            else [mean - local.shift, var]
        )
        stats_dtype = _moments.stat_dtype(input.dtype)
        shifted_mean, var, *running_update = torch.stack(rows).to(stats_dtype).unbind()
        ctx.param_dtype = None if weight is None else weight.dtype
        if weight is not None and weight.dtype != stats_dtype:  # e.g. model.half(): normalize in float32
            weight, bias = weight.to(stats_dtype), bias.to(stats_dtype)
        if update_running:
            _update_running_stats(running_mean, running_var, num_batches_tracked, momentum, *running_update)
        invstd = (var + eps).rsqrt_()
        output = torch.batch_norm(
            local.shifted, weight, bias, shifted_mean, var, False, 0.0, eps, torch.backends.cudnn.enabled
        )
        scale = invstd if weight is None else invstd * weight  # weight / std, what backward scales dy by
        ctx.save_for_backward(local.shifted, weight, shifted_mean, var, scale)
        ctx.eps = eps
        ctx.count = count
        ctx.reducer = reducer
        ctx.counter = counter
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        # ``input`` is the forward input shifted per channel, ``mean`` the global mean shifted alike.
        input, weight, mean, var, scale = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        if input.numel():
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward.default(
                grad_output, input, None, mean, var, None, None, False, ctx.eps, [False, True, True]
            )
        else:
            sum_dy_xhat = torch.zeros_like(mean)
            sum_dy = torch.zeros_like(mean)
        grad_input = None
        if need_input:
            grad_input = _sync_grad_input(
                ctx, grad_output, input, weight, mean, var, scale, sum_dy, sum_dy_xhat
            )
        grad_weight = sum_dy_xhat.to(ctx.param_dtype) if need_weight else None
        grad_bias = sum_dy.to(ctx.param_dtype) if need_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None, None


def _sync_grad_input(ctx, grad_output, input, weight, mean, var, scale, sum_dy, sum_dy_xhat) -> Tensor:
    """dx = scale * (dy - mean(dy) - x_hat * mean(dy * x_hat)), means over all participants."""
    tag = ctx.counter.next_tag(BACKWARD)
    payload = _moments.pack((sum_dy, sum_dy_xhat), 0, tag, failed=False)
    ctx.reducer.all_reduce(payload)
    _, sums = _moments.unpack(payload, ctx.reducer.world_size, tag, None)
    if not input.numel():
        return torch.empty_like(input)
    # The x_hat-dependent part and the constant in one fused eval-mode batch-norm pass, then + scale * dy.
    shift, slope = ((sums / -ctx.count).to(scale.dtype) * scale).unbind()
    grad_input = torch.batch_norm(input, slope, shift, mean, var, False, 0.0, ctx.eps, False)
    if grad_output.dtype == scale.dtype:
        return grad_input.addcmul_(grad_output, _moments.per_channel(scale, input.dim()))
    # Half inputs with float32 statistics: a mixed-dtype addcmul_ would make float32 copies of the whole
    # activation; mixed-precision eval-mode batch norm of dy computes weight / std * dy without any.
    zero = torch.zeros_like(mean)
    return grad_input.add_(torch.batch_norm(grad_output, weight, None, zero, var, False, 0.0, ctx.eps, False))
