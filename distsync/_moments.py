"""The moment arithmetic of synchronized batch norm, shared by every transport.

A sync payload is one float64 vector per call, the same length in forward and backward so that a rank in
the wrong direction meets a well-formed reduction instead of a size mismatch::

    [ first (C) | second (C) | count | failed | layer, direction, call | layer^2, direction^2, call^2 ]

Forward sends ``first = n * mean`` and ``second = M2 + n * mean^2`` (``M2`` the centred sum of squares);
backward sends ``first = sum(dy)`` and ``second = sum(dy * x_hat)``. The call identity is folded into the
sum: after a SUM over W ranks, ``(sum t)^2 == W * sum(t^2)`` holds for every identity field iff all ranks
sent the same value, so every rank reaches the same verdict from the same reduced numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .errors import SyncError, SyncMismatchError

FORWARD, BACKWARD = 0, 1
_DIRECTIONS = ("forward", "backward")
_TAIL = 8  # count, failed, 3 identity fields, their 3 squares
_CALL_MODULUS = 1 << 20  # keeps call^2 * W exact in float64 for W up to 2^12


class CallTag(NamedTuple):
    """Which layer, direction and call of that layer a payload belongs to (identical on every rank)."""

    layer_id: int
    direction: int
    call: int
    layer_name: str

    def describe(self) -> str:
        return f"{self.layer_name} (layer id {self.layer_id}), {_DIRECTIONS[self.direction]} call #{self.call}"


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the statistics used to normalize an input of ``dtype``: float32 at least."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reduce_dims(input: Tensor) -> list[int]:
    """All dimensions but the channel dimension 1."""
    return [0, *range(2, input.dim())]


class LocalMoments(NamedTuple):
    """This rank's per-channel statistics, and its input shifted by a per-channel value.

    Normalizing ``shifted`` with ``global_mean - shift`` avoids the rounding of ``x * a + b`` with large
    ``x`` when the mean is far from zero; the shift is the local mean where that costs no extra pass.
    """

    count: int
    mean: Tensor
    m2: Tensor
    shifted: Tensor
    shift: Tensor


def local_moments(input: Tensor) -> LocalMoments:
    """Count, mean and centred sum of squares per channel of this rank's batch (float64 for float32 and
    float64 inputs, float32 for half inputs, whose kernel accumulates in float32)."""
    num_channels = input.shape[1]
    count = input.numel() // num_channels if num_channels else 0
    dtype = stat_dtype(input.dtype)
    zeros = torch.zeros(num_channels, dtype=dtype, device=input.device)
    if count == 0:
        return LocalMoments(0, zeros, zeros, input, zeros)
    if input.dtype in (torch.float16, torch.bfloat16):
        # The fused kernel accumulates half inputs in float32 without an fp32 copy of the activation.
        # A float32 weight selects the mixed-precision kernel, whose statistics are float32.
        ones = torch.ones(num_channels, dtype=dtype, device=input.device)
        _, mean, invstd = torch.native_batch_norm(input, ones, None, None, None, True, 0.0, 0.0)
        m2 = torch.where(invstd > 0, count / invstd.double().square(), 0.0)  # invstd is 0 for var == 0
        return LocalMoments(count, mean.double(), m2, input, zeros)
    shift = input.sum(reduce_dims(input), dtype=dtype) / count
    shifted = input - _per_channel(shift, input.dim())
    # sum(s) and sum(s^2) of the shifted input in one pass (the eval-mode batch-norm backward reduces
    # exactly these); sum(s) corrects the rounding of the float32 sum behind the shift.
    ones = torch.ones_like(shift)
    _, sum_sq, sum_shifted = torch.ops.aten.native_batch_norm_backward(
        shifted, shifted, None, zeros, ones, None, None, False, 0.0, [False, True, True]
    )
    mean_shifted = sum_shifted.double() / count
    m2 = sum_sq.double() - sum_shifted.double() * mean_shifted
    return LocalMoments(count, shift.double() + mean_shifted, m2, shifted, shift)


def _per_channel(values: Tensor, ndim: int) -> Tensor:
    return values.view(1, -1, *([1] * (ndim - 2)))


def pack(first: Tensor, second: Tensor, count: int, tag: CallTag, failed: bool) -> Tensor:
    """Build the float64 payload of one sync call (see the module docstring for the layout)."""
    num_channels = first.numel()
    payload = torch.empty(2 * num_channels + _TAIL, dtype=torch.float64, device=first.device)
    payload[:num_channels] = first
    payload[num_channels : 2 * num_channels] = second
    ident = (tag.layer_id, tag.direction, tag.call % _CALL_MODULUS)
    tail = (float(count), float(failed), *ident, *(v * v for v in ident))
    payload[2 * num_channels :] = torch.tensor(tail, dtype=torch.float64)
    return payload


def forward_payload(
    input: Tensor | None, num_channels: int, device: torch.device, tag: CallTag
) -> tuple[Tensor, LocalMoments | None]:
    """Payload of moment sums for ``input`` and its local moments; ``None`` marks a rejected input."""
    if input is None:
        zeros = torch.zeros(num_channels, dtype=torch.float64, device=device)
        return pack(zeros, zeros, 0, tag, failed=True), None
    local = local_moments(input)
    mean64 = local.mean.double()
    sum_second = local.m2.double() + mean64.square() * local.count
    return pack(mean64 * local.count, sum_second, local.count, tag, failed=False), local


def unpack(payload: Tensor, world_size: int, tag: CallTag, problem: str | None) -> tuple[int, Tensor, Tensor]:
    """Check a reduced payload and split it into (global count, first sums, second sums).

    Raises the same error on every rank: :class:`SyncMismatchError` when ranks sent different call tags,
    ``ValueError`` on a rank whose own input was rejected and :class:`SyncError` on the others.
    """
    num_channels = (payload.numel() - _TAIL) // 2
    count, failed, *ident = payload[2 * num_channels :].tolist()
    sums, squares = ident[:3], ident[3:]
    disagreeing = [
        name
        for name, s, sq in zip(("layer", "direction", "call count"), sums, squares)
        if s * s != world_size * sq
    ]
    if disagreeing:
        raise SyncMismatchError(
            f"ranks are out of step at {tag.describe()}: the {world_size} ranks disagree on "
            f"{', '.join(disagreeing)}. Every rank must call the same synchronized BN layers in the same "
            "order and the same number of times (check data-dependent branches)."
        )
    if failed:
        if problem is not None:
            raise ValueError(problem)
        raise SyncError(f"{int(failed)} other rank(s) rejected their input at {tag.describe()}")
    return int(count), payload[:num_channels], payload[num_channels : 2 * num_channels]


def merge_moments(count: int, sum_first: Tensor, sum_second: Tensor) -> tuple[Tensor, Tensor]:
    """Global mean and centred sum of squares (float64) from reduced forward sums."""
    mean = sum_first / count
    m2 = (sum_second - mean * sum_first).clamp_min_(0.0)
    return mean, m2
