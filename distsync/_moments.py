"""The moment arithmetic of synchronized batch norm, shared by every transport.

A sync payload is one float64 vector per call, the same length in forward and backward so that a rank in
the wrong direction meets a well-formed reduction instead of a size mismatch::

    [ first (C) | second (C) | count | failed | layer, direction, call | layer^2, direction^2, call^2 ]

Forward sends ``first = sum(x)`` and ``second = sum(x^2)``, both computed from a shifted input so that
nothing cancels (see :class:`LocalMoments`); backward sends ``first = sum(dy)`` and
``second = sum(dy * x_hat)``. The call identity is folded into the sum: after a SUM over W ranks,
``(sum t)^2 == W * sum(t^2)`` holds for every identity field iff all ranks sent the same value, so every
rank reaches the same verdict from the same reduced numbers.
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
        return (
            f"{self.layer_name} (layer id {self.layer_id}), {_DIRECTIONS[self.direction]} call #{self.call}"
        )


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the statistics used to normalize an input of ``dtype``: float32 at least."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class LocalMoments(NamedTuple):
    """This rank's contribution to the forward payload, and its input shifted per channel.

    ``sums`` holds ``sum(x)`` and ``sum(x^2)`` per channel in float64, computed as sums of the shifted
    input ``x - shift`` so that no large terms cancel. Normalizing ``shifted`` with ``mean - shift``
    also keeps the output accurate when the mean is far from zero (``x * a + b`` with large ``x`` would
    round it away). The shift is one sample's values for float32/float64 inputs, zero for half inputs.
    """

    sums: tuple[Tensor, Tensor]  # sum(x), sum(x^2): (C,) float64 each
    shifted: Tensor
    shift: Tensor  # (C,) float64


def local_moments(input: Tensor) -> LocalMoments:
    """Per-channel ``sum(x)`` and ``sum(x^2)`` of this rank's batch, accurate for any mean."""
    num_channels = input.shape[1]
    count = input.numel() // num_channels if num_channels else 0
    if count == 0:
        no_shift = torch.zeros(num_channels, dtype=torch.float64, device=input.device)
        return LocalMoments((no_shift, no_shift), input, no_shift)
    if input.dtype in (torch.float16, torch.bfloat16):
        # Mean and biased variance straight from the half input, accumulated in float32 with no float32
        # copy of it and no output written: float32 running buffers select the mixed-precision kernel, and
        # with momentum 1 they are scratch space.
        scratch_mean, scratch_var = torch.zeros(2, num_channels, device=input.device).unbind()
        mean, var = torch.batch_norm_update_stats(input, scratch_mean, scratch_var, 1.0)
        mean, var = torch.stack([mean, var]).double().unbind()
        sum_x = mean * count
        return LocalMoments((sum_x, torch.addcmul(var * count, sum_x, mean)), input, torch.zeros_like(sum_x))
    # Any in-batch value is within a few standard deviations of the mean: shift by the first sample's,
    # a view that costs no pass over the data.
    shift = input[(0, slice(None), *[0] * (input.dim() - 2))]
    shifted = input - per_channel(shift, input.dim())
    # sum(s) and sum(s * (x - shift)) = sum(s^2) in one pass: exactly what eval-mode BN backward reduces.
    _, sum_sq, sum_shifted = torch.ops.aten.native_batch_norm_backward(
        shifted, input, None, shift, torch.ones_like(shift), None, None, False, 0.0, [False, True, True]
    )
    sum_shifted, sum_sq, shift = torch.stack([sum_shifted, sum_sq, shift]).double().unbind()
    sum_x = torch.add(sum_shifted, shift, alpha=count)
    sum_x2 = torch.addcmul(sum_sq, shift, sum_x + sum_shifted)  # sum (shift + s)^2
    return LocalMoments((sum_x, sum_x2), shifted, shift)


def per_channel(values: Tensor, ndim: int) -> Tensor:
    """View a (C,) tensor so that it broadcasts over an (N, C, *) input of ``ndim`` dimensions."""
    return values.view(1, -1, *([1] * (ndim - 2)))


def pack(sums: tuple[Tensor, Tensor], count: int, tag: CallTag, failed: bool) -> Tensor:
    """The float64 payload of one sync call from its two per-channel sums (see the module docstring)."""
    ident = (tag.layer_id, tag.direction, tag.call % _CALL_MODULUS)
    tail = (float(count), float(failed), *ident, *(v * v for v in ident))
    # cat promotes float32 sums to the tail's float64.
    return torch.cat([*sums, torch.tensor(tail, dtype=torch.float64, device=sums[0].device)])


def forward_payload(
    input: Tensor | None, num_channels: int, device: torch.device, tag: CallTag
) -> tuple[Tensor, LocalMoments | None]:
    """Payload of moment sums for ``input`` and its local moments; ``None`` marks a rejected input."""
    if input is None:
        zeros = torch.zeros(num_channels, dtype=torch.float64, device=device)
        return pack((zeros, zeros), 0, tag, failed=True), None
    local = local_moments(input)
    return pack(local.sums, input.numel() // max(num_channels, 1), tag, failed=False), local


def unpack(payload: Tensor, world_size: int, tag: CallTag, problem: str | None) -> tuple[int, Tensor]:
    """Check a reduced payload and split it into the global count and the (2, C) reduced sums.

    Raises the same error on every rank: :class:`SyncMismatchError` when ranks sent different call tags,
    ``ValueError`` on a rank whose own input was rejected and :class:`SyncError` on the others.
    """
    num_channels = (payload.numel() - _TAIL) // 2
    count, failed, *ident = payload[2 * num_channels :].tolist()
    sums, squares = ident[:3], ident[3:]
    disagreeing = [
        name
        for name, s, sq in zip(("layer", "direction", "call count"), sums, squares, strict=True)
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
    return int(count), payload[: 2 * num_channels].view(2, num_channels)


def merge_moments(count: int, sums: Tensor) -> tuple[Tensor, Tensor]:
    """Global mean and biased variance (float64) from the reduced ``sum(x)`` and ``sum(x^2)``.

    The sums are exact to float64 rounding (see :class:`LocalMoments`), so ``E[x^2] - E[x]^2`` loses
    only ``log10(mean^2 / var)`` of float64's 16 digits: 8 for a mean 1e4 times the standard deviation.
    """
    mean, mean_sq = (sums / count).unbind()
    return mean, torch.addcmul(mean_sq, mean, mean, value=-1).clamp_min_(0.0)
