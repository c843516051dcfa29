"""Synchronized batch normalization as an autograd Function: one all-reduce forward, one backward."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from distsync._syncbn import checkpointing as _checkpointing
from distsync._syncbn import health as _health
from distsync._syncbn import moments as _moments
from distsync._syncbn.identity import BACKWARD, COUNT, FORWARD, CallTag, SyncState, failed_row
from distsync._syncbn.kernels import cast_if_needed, kernels_for
from distsync._syncbn.transport import Call, Reducer
from distsync.errors import SyncError

__all__ = ["SyncBatchNormFunction", "shadow_backward", "shadow_forward", "sync_backward_sums"]


def _all_reduce(reducer: Reducer, payload: Tensor, tag: CallTag) -> None:
    try:
        reducer.all_reduce(payload)
    except SyncError:
        raise
    except RuntimeError as error:  # a dead peer, a timeout: say which layer and call was waiting
        raise SyncError(f"the all-reduce of {tag.describe()} failed: {error}") from error


def _check(
    payload: Tensor, tag: CallTag, reducer: Reducer, problem: str | None, training: bool, kernels
) -> _moments.Verdict | None:
    """Raise now on the CPU, where the reduced values cost nothing to read, and return the (healthy)
    verdict; elsewhere (and under ``torch.compile``, which must not read them) defer the check to
    ``_health`` and return None."""
    tail = payload[payload.numel() - _moments.TAIL :]
    world_size = reducer.world_size
    if not (kernels.deferred or torch.compiler.is_compiling()):
        verdict = _moments.verdict(tail.tolist(), world_size)
        _moments.raise_for(verdict, tag, world_size, problem, training)
        return verdict
    if problem is not None:  # this rank knows already; the others learn it from the reduced flag
        raise ValueError(problem)
    _health.defer(tail, tag, world_size, training, getattr(reducer, "timeout", None))
    return None


def _update_running_stats_read(buffers, momentum: float | None, ends, global_count: int) -> None:
    """Move the running statistics towards this call's, whose verdict was read on the host (and is
    healthy: a bad call raised), as ``nn.BatchNorm`` does: by ``momentum`` or ``1 / num_batches_tracked``."""
    running_mean, running_var, num_batches_tracked = buffers
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if global_count == 0:  # an empty global batch: no statistics (0 / 0), keep the old ones
        return
    weight = momentum if momentum is not None else 1.0 / float(num_batches_tracked)
    dtype = _buffer_math_dtype(running_mean)
    _lerp_buffers((running_mean, running_var), (end.to(dtype) for end in ends), weight, dtype)


def _buffer_math_dtype(buffer: Tensor) -> torch.dtype:
    return torch.float32 if buffer.dtype in (torch.float16, torch.bfloat16) else buffer.dtype


def _lerp_buffers(buffers, ends, weight: float | Tensor, dtype: torch.dtype) -> None:
    """``buffer += weight * (end - buffer)`` for each pair, computed in ``dtype`` (float32 for half
    buffers, where ``1 / num_batches_tracked`` does not underflow). A half buffer takes the form of
    ``nn.BatchNorm``'s kernels, ``(1 - weight) * buffer + weight * end`` (CPU: ``batch_norm_kernel.cpp``;
    CUDA: ``batch_norm_update_stats_and_invert`` in ``aten/src/ATen/native/cuda/Normalization.cu`` and
    ``batch_norm_collect_statistics_kernel`` in ``Normalization.cuh``, in the accumulate type, stored as
    the buffer's): a variance beyond fp16's range stays inf, where ``lerp`` would turn it into NaN
    (``inf - inf``) one call later. Plain elementwise ops on the buffer's device, no host read."""
    for buffer, end in zip(buffers, ends, strict=True):
        if buffer.dtype == dtype:
            buffer.lerp_(end, weight)
        else:
            buffer.copy_(buffer.to(dtype).mul_(1 - weight).add_(end * weight))


def _update_running_stats(
    state: SyncState, buffers, momentum, payload: Tensor, ends, guard_count: bool
) -> None:
    """Move the running statistics towards this call's, by a weight that is 0 for a bad call (decided
    on the device, from reduced values: the verdict is not read yet)."""
    running_mean, running_var, num_batches_tracked = buffers
    dtype = _buffer_math_dtype(running_mean)
    key = ("weight", running_mean.device, dtype)
    weight = state.scratch.get(key)
    if weight is None:
        weight = state.scratch[key] = torch.zeros(1, dtype=dtype, device=running_mean.device)
    # num_batches_tracked counts healthy calls only, decided from reduced values: the same on every rank,
    # the one that rejected its input included (it never gets here, and the call counts on no rank).
    _moments.running_stat_weight(payload, momentum, weight, num_batches_tracked)
    mean, var = (end.to(dtype) for end in ends)
    if guard_count:  # some rank may have had 0 or 1 value: statistics may be NaN, keep the old ones then
        enough = payload[payload.numel() - _moments.TAIL + COUNT] > 1
        mean = torch.where(enough, mean, running_mean.to(dtype))
        var = torch.where(enough, var, running_var.to(dtype))
    _lerp_buffers((running_mean, running_var), (mean, var), weight, dtype)


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm whose statistics are those of the union of all participants' batches.

    Forward reduces per-channel count, mean and variance as shifted moment sums (float64); backward reduces
    the two per-channel sums of the gradient formula. The shift only moves on healthy calls, so an empty
    global batch, a NaN/Inf element or an outlier changes no later call's result (``_moments``). Weight and
    bias gradients stay local, like ``nn.SyncBatchNorm``: DistributedDataParallel averages them. Not twice
    differentiable.
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
        clip: bool,
        num_features: int,
        reducer: Reducer,
        state: SyncState,
        problem: str | None,
    ) -> Tensor:
        kernels = kernels_for(input.device)
        count = 0 if problem else input.numel() // max(num_features, 1)
        local = None if problem is not None or count == 0 else kernels.local(input)
        # Recomputed by activation checkpointing: the original call's statistics, no all-reduce, no update.
        checkpointed = _checkpointing.regions() if problem is None else _checkpointing.OUTSIDE
        reduced = None
        if checkpointed.replaying is not None:
            stats = checkpointed.replay(state, input)
        else:
            call = Call(FORWARD, state, num_features, input.dtype, momentum, eps, running_mean, running_var,
                        num_batches_tracked is not None)  # fmt: skip
            reduced = _reduce(input, local, count, call, reducer, problem, kernels)
            stats = reduced.stats
        checkpointed.log(state, input, stats)
        normalized = None if local is None else kernels.normalize(local, weight, bias, stats.rows, eps, clip)
        if reduced is not None and running_mean is not None and running_var is not None:
            mean, _, unbiased = stats.rows.unbind()
            ends = (mean, unbiased) if normalized is None else normalized.running
            buffers = (running_mean, running_var, num_batches_tracked)
            if reduced.verdict is not None:
                _update_running_stats_read(buffers, momentum, ends, reduced.verdict.count)
            else:
                _update_running_stats(state, buffers, momentum, reduced.payload, ends, guard_count=count <= 1)
        ctx.param_dtype = None if weight is None else weight.dtype
        ctx.num_features = num_features
        ctx.reducer, ctx.state, ctx.kernels = reducer, state, kernels
        if normalized is None:  # nothing on this rank: an empty output; backward sends zeros
            ctx.empty = True
            return torch.empty_like(input)
        ctx.empty = False
        ctx.eps = normalized.eps
        ctx.save_for_backward(local.z, weight, stats.count, *normalized.saved)
        return normalized.output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        nones = (None,) * 10
        if ctx.empty:
            zeros = torch.zeros(ctx.num_features, dtype=torch.float64, device=grad_output.device)
            if need_input:
                _sync_backward(ctx, zeros, zeros)
            grad_weight = zeros.to(ctx.param_dtype) if need_weight else None
            grad_bias = zeros.to(ctx.param_dtype) if need_bias else None
            return torch.empty_like(grad_output) if need_input else None, grad_weight, grad_bias, *nones
        z, weight, count, *saved = ctx.saved_tensors
        kernels = ctx.kernels
        dy = kernels.match_layout(grad_output, z)
        first, second, grad_weight, grad_bias = kernels.backward_sums(
            dy, z, saved, weight, need_weight, need_bias, ctx.eps
        )
        grad_input = None
        if need_input:
            reduced = _sync_backward(ctx, first, second)
            grad_input = kernels.grad_input(dy, z, saved, weight, reduced, count, ctx.eps)
        grad_weight = cast_if_needed(grad_weight, ctx.param_dtype) if need_weight else None
        grad_bias = cast_if_needed(grad_bias, ctx.param_dtype) if need_bias else None
        return grad_input, grad_weight, grad_bias, *nones


class _Reduced(NamedTuple):
    stats: _moments.Stats  # rows: the global mean, biased and unbiased variance
    verdict: _moments.Verdict | None  # read on the host (None: deferred to the device)
    payload: Tensor  # the reduced payload, whose tail the deferred running-statistics update reads


def _reduce(input, local, count, call: Call, reducer, problem, kernels) -> _Reduced:
    """This call's global statistics: its all-reduce (two where the first merge lost digits)."""
    state, num_features, eps = call.state, call.channels, call.eps
    tag = state.next_tag(FORWARD)
    row = state.tail(tag, reducer.world_size, reducer.first, input.device, num_features)
    keeps_shift = _keeps_shift(input, kernels)
    if state.shift is not None and state.shift.device != input.device:
        state.shift = state.shift_ref = None  # the layer moved: start again from zero
    shift = state.shift if keeps_shift else None
    payload = _pack(local, shift, count, row, num_features, problem)
    reducer.announce(call)  # the second all-reduce below is decided alike on every rank: not announced
    _all_reduce(reducer, payload, tag)
    verdict = _check(payload, tag, reducer, problem, True, kernels)
    stats = _moments.merge(payload, num_features, state.scratch)
    mean, biased, _ = stats.rows.unbind()  # mean - shift, biased and unbiased variance (float64)
    if keeps_shift and _shift_costs_accuracy(mean, biased, eps, input.device, kernels.deferred):
        # Rare, CPU only, decided from reduced values on every rank: merge again around this mean.
        shift = mean if shift is None else mean + shift
        shift = torch.where(shift.isfinite(), shift, 0.0)
        payload = _pack(local, shift, count, row, num_features, None)
        _all_reduce(reducer, payload, tag)
        verdict = _check(payload, tag, reducer, None, True, kernels)
        stats = _moments.merge(payload, num_features, state.scratch)
        mean, biased, _ = stats.rows.unbind()
    if shift is not None:
        mean.add_(shift)  # rows[0] too: now the global mean itself
    if keeps_shift:
        _moments.update_shift(state, mean, biased)
    return _Reduced(stats, verdict, payload)


def _sync_backward(ctx, first: Tensor, second: Tensor) -> Tensor:
    """All-reduce this rank's backward sums; return the reduced (2, C) sums (a view of the payload)."""
    return sync_backward_sums(ctx.state, ctx.reducer, ctx.kernels, first, second)


def sync_backward_sums(state: SyncState, reducer: Reducer, kernels, first: Tensor, second: Tensor) -> Tensor:
    """The backward all-reduce of a call of the layer of ``state``: this rank's two gradient sums (C each)
    summed over the participants, as a (2, C) view of the payload."""
    tag = state.next_tag(BACKWARD)
    row = state.tail(tag, reducer.world_size, reducer.first, first.device, first.numel())
    payload = _moments.pack_sums(first, second, row)
    reducer.announce(Call(BACKWARD, state, first.numel(), first.dtype))
    _all_reduce(reducer, payload, tag)
    _check(payload, tag, reducer, None, False, kernels)
    return payload[: 2 * first.numel()].view(2, -1)


def _keeps_shift(input: Tensor, kernels) -> bool:
    """Merge around the previous global mean where the input's precision is worth it (the same on every
    rank): on the CPU, whose float32/float64 path keeps its accuracy for any mean, and for float64."""
    if input.dtype in (torch.float16, torch.bfloat16):
        return False
    return kernels.keeps_any_shift or input.dtype == torch.float64


def _pack(local, shift: Tensor | None, count: int, row: Tensor, num_features: int, problem) -> Tensor:
    """This rank's forward payload around ``shift`` (None for zero); zeros for no input or a rejected one."""
    if local is None:
        zeros = row.new_zeros(num_features)
        if problem is not None:
            return _moments.pack_sums(zeros, zeros, failed_row(row))
        return _moments.pack_moments(zeros, zeros, None, 0, row)
    return _moments.pack_moments(local.mean, local.var, _base(shift, local), count, row)


def _base(shift: Tensor | None, local) -> Tensor | None:
    """The shared shift in the coordinates of ``local``'s moments: ``K - origin`` (None for zero)."""
    if local.origin is None:
        return shift
    origin = local.origin.double()
    return -origin if shift is None else shift - origin


def _shift_costs_accuracy(
    mean: Tensor, var: Tensor, eps: float, device: torch.device, deferred: bool = False
) -> bool:
    """Whether the merge lost more than ``_moments.REFINE_DIGITS`` digits (read on the CPU only, where it is
    free, and only where verdicts are read at the call; a device keeps to one all-reduce and relies on the
    shift's health rules)."""
    if device.type != "cpu" or deferred or torch.compiler.is_compiling():
        return False
    return bool(_moments.costs_accuracy(mean, var, eps).item())


def shadow_forward(layer, call: Call, reducer: Reducer, device: torch.device) -> None:
    """Take part in another rank's forward ``call`` of ``layer`` with no samples (a rank that joined under
    DDP's ``Join``): contribute an empty payload and move the running statistics the call names (this
    rank's own buffers of the layer) as the others move theirs, from the reduced values, counting the batch
    where the call does. No user code runs."""
    counted = layer.num_batches_tracked if call.counts else None
    empty = torch.empty((0, call.channels), dtype=call.dtype, device=device)
    with torch.no_grad():
        SyncBatchNormFunction.apply(
            empty, None, None, call.running_mean, call.running_var, counted, call.momentum, call.eps, False,
            call.channels, reducer, call.state, None,
        )  # fmt: skip


def shadow_backward(call: Call, reducer: Reducer, device: torch.device) -> None:
    """Take part in another rank's backward ``call`` with zero gradient sums (see :func:`shadow_forward`)."""
    zeros = torch.zeros(call.channels, dtype=torch.float64, device=device)
    sync_backward_sums(call.state, reducer, kernels_for(device), zeros, zeros)
