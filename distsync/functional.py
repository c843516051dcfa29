"""Synchronized batch normalization as an autograd Function: one all-reduce forward, one backward."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from distsync._syncbn import checkpointing as _checkpointing
from distsync._syncbn import health as _health
from distsync._syncbn import payload as _payload
from distsync._syncbn.kernels import cast_if_needed, kernels_for
from distsync._syncbn.payload import BACKWARD, COUNT, FORWARD, Call, CallTag, Reducer, SyncState, failed_row
from distsync.errors import SyncError

__all__ = ["SyncBatchNormFunction", "SyncCall", "shadow_backward", "shadow_forward", "sync_backward_sums"]


class SyncCall(NamedTuple):
    """What a synchronized call needs besides its input and parameters (``F.batch_norm``'s other arguments,
    and who it syncs with)."""

    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None  # counted by this call (None: its caller counts, or no buffers)
    momentum: float | None
    eps: float
    clip: bool  # eps mode "clamp": sqrt(max(var, eps)) instead of sqrt(var + eps)
    channels: int
    reducer: Reducer
    state: SyncState
    problem: str | None  # this rank's input is rejected: every participant raises at this call


def _all_reduce(reducer: Reducer, payload: Tensor, tag: CallTag) -> None:
    try:
        reducer.all_reduce(payload)
    except SyncError:
        raise
    except RuntimeError as error:  # a dead peer, a timeout: say which layer and call was waiting
        raise SyncError(f"the all-reduce of {tag.describe()} failed: {error}") from error


def _check(
    payload: Tensor, tag: CallTag, reducer: Reducer, problem: str | None, training: bool, kernels
) -> _payload.Verdict | None:
    """Raise now on the CPU, where the reduced values cost nothing to read, and return the (healthy)
    verdict; elsewhere (and under ``torch.compile``, which must not read them) defer the check to
    ``_health`` and return None."""
    tail = payload[payload.numel() - _payload.TAIL :]
    world_size = reducer.world_size
    if not (kernels.deferred or torch.compiler.is_compiling()):
        verdict = _payload.verdict(tail.tolist(), world_size)
        _payload.raise_for(verdict, tag, world_size, problem, training)
        return verdict
    if problem is not None:  # this rank knows already; the others learn it from the reduced flag
        raise ValueError(problem)
    _health.defer(tail, tag, world_size, training, getattr(reducer, "timeout", None))
    return None


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


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm whose statistics are those of the union of all participants' batches.

    Forward reduces per-channel count, mean and variance as shifted moment sums (float64); backward reduces
    the two per-channel sums of the gradient formula. The shift only moves on healthy calls, so an empty
    global batch, a NaN/Inf element or an outlier changes no later call's result (``_payload``). Weight and
    bias gradients stay local, like ``nn.SyncBatchNorm``: DistributedDataParallel averages them. Not twice
    differentiable. One forward and one backward for every device: what touches the activation is the
    device's row of ``_syncbn.kernels``; off the CPU the reduced values stay on the device, never read by
    the host.
    """

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor | None, bias: Tensor | None, call: SyncCall) -> Tensor:
        kernels = kernels_for(input.device)
        ctx.param_dtype = None if weight is None else weight.dtype
        ctx.call, ctx.kernels = call, kernels
        return _forward(ctx, input, weight, bias, call, kernels)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        call = ctx.call
        if ctx.empty:  # nothing on this rank: it sends zeros, and its own gradients are zeros
            zeros = torch.zeros(call.channels, dtype=torch.float64, device=grad_output.device)
            if need_input:
                sync_backward_sums(call.state, call.reducer, ctx.kernels, zeros, zeros)
            grad_weight = zeros.to(ctx.param_dtype) if need_weight else None
            grad_bias = zeros.to(ctx.param_dtype) if need_bias else None
            return torch.empty_like(grad_output) if need_input else None, grad_weight, grad_bias, None
        return _backward(ctx, grad_output, need_input, need_weight, need_bias)


def _forward(ctx, input: Tensor, weight, bias, call: SyncCall, kernels) -> Tensor:
    state, problem, channels = call.state, call.problem, call.channels
    count = 0 if problem is not None else input.numel() // channels
    local = None if problem is not None or count == 0 else kernels.local(input, state.scratch)
    # Recomputed by activation checkpointing: the original call's statistics, no all-reduce, no update.
    checkpointed = _checkpointing.regions() if problem is None else _checkpointing.OUTSIDE
    payload = verdict = None
    if checkpointed.replaying is not None:
        stats = checkpointed.replay(state, input)
    else:
        stats, payload, verdict = _reduce(input, local, count, call, kernels)
    checkpointed.log(state, input, stats)
    normalized = None
    if local is not None:
        normalized = kernels.normalize(local, weight, bias, stats.rows, call.eps, call.clip, state.scratch)
    if payload is not None and call.running_mean is not None and call.running_var is not None:
        ends = (stats.mean, stats.unbiased) if normalized is None else normalized.running
        _update_running_stats(state, call, payload, ends, verdict, count)
    if normalized is None:  # nothing on this rank: an empty output; backward sends zeros
        ctx.empty = True
        return torch.empty_like(input)
    ctx.empty = False
    ctx.save_for_backward(local.z, weight, stats.count, *normalized.saved)
    return normalized.output


def _reduce(
    input: Tensor, local, count: int, call: SyncCall, kernels
) -> tuple[_payload.Stats, Tensor, _payload.Verdict | None]:
    """This call's global statistics (mean absolute), its reduced payload and, where the kernels read it at
    the call, its verdict (else None: deferred to the device's health checks).

    One all-reduce; where the verdict is read at the call (the CPU) and a float64 merge lost digits (the
    first call far from zero, a mean that jumped), a second one around the merged mean, decided alike on
    every rank from reduced values."""
    state, reducer, channels, eps, problem = call.state, call.reducer, call.channels, call.eps, call.problem
    tag = state.next_tag(FORWARD)
    row = state.tail(tag, reducer.world_size, reducer.first, input.device, channels)
    keeps_shift = _keeps_shift(input, kernels)
    if state.shift is not None and state.shift.device != input.device:
        state.shift = state.shift_ref = None  # the layer moved: start again from zero
    shift = state.shift if keeps_shift else None
    payload = _pack(local, shift, count, row, channels, problem)
    reducer.announce(
        Call(FORWARD, state, channels, input.dtype, call.momentum, eps, call.running_mean,
             call.running_var, call.num_batches_tracked is not None)
    )  # fmt: skip
    _all_reduce(reducer, payload, tag)
    verdict = _check(payload, tag, reducer, problem, True, kernels)
    stats = _payload.merge(payload, channels, state.scratch, eps, call.clip)
    if verdict is not None and verdict.count and input.dtype == torch.float64:
        if bool(_payload.costs_accuracy(stats.mean, stats.var)):
            shift = stats.mean if shift is None else stats.mean + shift
            shift = torch.where(shift.isfinite(), shift, 0.0)
            payload = _pack(local, shift, count, row, channels, None)
            _all_reduce(reducer, payload, tag)
            _check(payload, tag, reducer, None, True, kernels)
            stats = _payload.merge(payload, channels, state.scratch, eps, call.clip)
    if shift is not None:
        stats.mean.add_(shift)  # was relative to the shift, now the global mean itself
    if keeps_shift:
        _payload.update_shift(state, stats.mean, stats.var)
    return stats, payload, verdict


def _update_running_stats(
    state: SyncState,
    call: SyncCall,
    payload: Tensor,
    ends,
    verdict: _payload.Verdict | None,
    local_count: int,
) -> None:
    """Move the running statistics towards this call's, by a weight that is 0 for a bad call: a number
    where the verdict was read, else decided on the device from reduced values."""
    running_mean, running_var, counted = call.running_mean, call.running_var, call.num_batches_tracked
    dtype = _buffer_math_dtype(running_mean)
    if verdict is not None:  # a healthy call (else it raised)
        if counted is not None:
            counted.add_(1)
        if verdict.count == 0:  # an empty global batch: no statistics (0 / 0), keep the old ones
            return
        weight = call.momentum if call.momentum is not None else 1.0 / float(counted)
        weights = weight
        mean, var = (cast_if_needed(end, dtype) for end in ends)
    else:
        # one per channel: the buffers' update is then one multi-tensor kernel
        weight = state.scratch.kept(
            ("weight", running_mean.device, dtype, running_mean.numel()),
            lambda: torch.zeros(running_mean.numel(), dtype=dtype, device=running_mean.device),
        )
        # num_batches_tracked counts healthy calls only, decided from reduced values: the same on every
        # rank, the one that rejected its input included (it never gets here, and counts on no rank).
        _payload.running_stat_weight(payload, call.momentum, weight, counted)
        weights = [weight, weight]
        mean, var = (cast_if_needed(end, dtype) for end in ends)
        if local_count <= 1:  # some rank may have had 0 or 1 value: NaN statistics, keep the old ones then
            enough = payload[payload.numel() - _payload.TAIL + COUNT] > 1
            mean = torch.where(enough, mean, running_mean.to(dtype))
            var = torch.where(enough, var, running_var.to(dtype))
    if running_mean.dtype == running_var.dtype == dtype:
        torch._foreach_lerp_([running_mean, running_var], [mean, var], weights)
    else:
        _lerp_buffers((running_mean, running_var), (mean, var), weight, dtype)


def _backward(ctx, grad_output: Tensor, need_input: bool, need_weight: bool, need_bias: bool):
    z, weight, count, *saved = ctx.saved_tensors
    kernels, call = ctx.kernels, ctx.call
    dy = kernels.match_layout(grad_output, z)
    first, second, grad_weight, grad_bias = kernels.backward_sums(
        dy, z, saved, weight, need_input, need_weight, need_bias
    )
    grad_input = None
    if need_input:
        reduced = sync_backward_sums(call.state, call.reducer, kernels, first, second)
        grad_input = kernels.grad_input(dy, z, saved, weight, reduced, count, _ones(call.state, z.device))
    grad_weight = cast_if_needed(grad_weight, ctx.param_dtype) if need_weight else None
    grad_bias = cast_if_needed(grad_bias, ctx.param_dtype) if need_bias else None
    return grad_input, grad_weight, grad_bias, None


def _ones(state: SyncState, device: torch.device) -> Tensor:
    """A count of 1 as ``batch_norm_backward_elemt`` reads counts (int32), kept on the device."""
    return state.scratch.kept(("ones", device), lambda: torch.ones(1, dtype=torch.int32, device=device))


def sync_backward_sums(state: SyncState, reducer: Reducer, kernels, first: Tensor, second: Tensor) -> Tensor:
    """The backward all-reduce of a call of the layer of ``state``: this rank's two gradient sums (C each)
    summed over the participants, as a (2, C) view of the payload."""
    tag = state.next_tag(BACKWARD)
    row = state.tail(tag, reducer.world_size, reducer.first, first.device, first.numel())
    payload = _payload.pack_sums(first, second, row)
    reducer.announce(Call(BACKWARD, state, first.numel(), first.dtype))
    _all_reduce(reducer, payload, tag)
    _check(payload, tag, reducer, None, False, kernels)
    return payload[: 2 * first.numel()].view(2, -1)


def _keeps_shift(input: Tensor, kernels) -> bool:
    """Merge around the previous global mean where the input's precision is worth it (the same on every
    rank): devices whose statistics keep their accuracy for any mean, and float64."""
    if input.dtype in (torch.float16, torch.bfloat16):
        return False
    return kernels.keeps_any_shift or input.dtype == torch.float64


def _pack(local, shift: Tensor | None, count: int, row: Tensor, channels: int, problem) -> Tensor:
    """This rank's forward payload around ``shift`` (None for zero); zeros for no input or a rejected one."""
    if local is None:
        zeros = row.new_zeros(channels)
        if problem is not None:
            return _payload.pack_sums(zeros, zeros, failed_row(row))
        return _payload.pack_moments(zeros, zeros, 0, row)
    return _payload.pack_moments(local.mean, local.var, count, row, _deviation(shift, local))


def _deviation(shift: Tensor | None, local) -> Tensor | None:
    """``local``'s mean minus the shared shift K, in float64: ``m - (K - origin)`` for moments about an
    origin, each difference rounded once; None where ``local.mean`` is that already (no origin, no shift)."""
    if local.origin is None:
        return None if shift is None else torch.sub(local.mean, shift)
    if shift is None:  # m - (0 - origin), in float64: the CPU's mean is, other devices' origin is made so
        origin = local.origin if local.mean.dtype == torch.float64 else local.origin.double()
        return torch.add(local.mean, origin)
    return torch.sub(local.mean, shift - local.origin)


def shadow_forward(layer, call: Call, reducer: Reducer, device: torch.device) -> None:
    """Take part in another rank's forward ``call`` of ``layer`` with no samples (a rank that joined under
    DDP's ``Join``): contribute an empty payload and move the running statistics the call names (this
    rank's own buffers of the layer) as the others move theirs, from the reduced values, counting the batch
    where the call does. No user code runs."""
    counted = layer.num_batches_tracked if call.counts else None
    empty = torch.empty((0, call.channels), dtype=call.dtype, device=device)
    with torch.no_grad():
        sync = SyncCall(
            call.running_mean, call.running_var, counted, call.momentum, call.eps, False, call.channels,
            reducer, call.state, None,
        )  # fmt: skip
        SyncBatchNormFunction.apply(empty, None, None, sync)


def shadow_backward(call: Call, reducer: Reducer, device: torch.device) -> None:
    """Take part in another rank's backward ``call`` with zero gradient sums (see :func:`shadow_forward`)."""
    zeros = torch.zeros(call.channels, dtype=torch.float64, device=device)
    sync_backward_sums(call.state, reducer, kernels_for(device), zeros, zeros)
