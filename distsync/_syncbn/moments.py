"""The moment arithmetic of synchronized batch norm, shared by every device and transport.

A sync payload is one float64 vector per call, the same length in forward and backward so that a rank in
the wrong direction meets a well-formed reduction instead of a size mismatch::

    [ first (C) | second (C) | zeros | tail (TAIL) ]

Its length is a size class (``_identity.payload_size``; the tail tables hold the zeros): ``2C + TAIL`` rounded
up to a power of two, at least ``MIN_PAYLOAD``. Ranks out of step at layers of different widths then still
meet equal sizes in most cases (every width up to 120 channels shares the smallest class), and the tail at the
end makes them raise ``SyncMismatchError``; a collective of unequal sizes would abort the process in gloo (and
hang in NCCL). It costs at most twice the bytes of an all-reduce that is bound by its latency anyway.

Forward sends ``first = n (m - K)`` and ``second = n (v + (m - K)^2)`` from this rank's ``n`` values per
channel, their mean ``m`` and biased variance ``v``, around a shift ``K`` that every rank shares (a previous
healthy global mean where accuracy needs it, else zero: see :func:`update_shift`), so the merge ``E[(x-K)^2] -
E[x-K]^2`` cancels only what ``|mean - K|`` makes it cancel. Backward sends the local sums of its gradient
formula.

The tail (see :mod:`distsync._syncbn.identity`) carries the count, a rejected-input flag and the call identity
folded so that every rank reaches the same verdict from the same reduced numbers without reading them:
:func:`running_stat_weight` turns the verdict into the weight of the running-statistics update on the
device, and :func:`verdict` decodes it on the host when the numbers are read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from distsync._syncbn.identity import (
    CALL,
    COUNT,
    DIRECTION,
    FAILED,
    GUARD,
    IDENTITY,
    SQUARES,
    TAIL,
    CallTag,
)
from distsync.errors import SyncError, SyncMismatchError


class Stats(NamedTuple):
    """Global statistics of one forward sync on a device: float64 rows of one ``(2, 2, C)`` tensor,
    ``[[mean, invstd], [var, unbiased var]]`` (``var`` is the biased variance plus eps, or the variance
    clamped at eps: what ``invstd`` is the inverse square root of), see :func:`merge`."""

    rows: Tensor
    count: Tensor  # (1,) float64 view of the global count, on the device


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the statistics used to normalize an input of ``dtype``: float32 at least."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack_moments(mean: Tensor, var: Tensor, base: Tensor | None, count: int, row: Tensor) -> Tensor:
    """Forward payload from this rank's per-channel ``mean`` and biased ``var`` of ``count`` values.

    ``base`` is ``K - origin``: the shared shift in the coordinates ``mean`` is given in (None for 0).
    ``row`` is the call's padded tail; its count slot holds 1 and becomes ``count`` here.
    """
    c = mean.numel()
    if base is None:  # cat promotes mean and var to float64 (exactly); v + d^2 in float64
        payload = torch.cat([mean, var, row])
        d = payload[:c]
        payload[c : 2 * c].addcmul_(d, d)
    else:
        d = torch.sub(mean, base)  # float64
        payload = torch.cat([d, torch.addcmul(var, d, d), row])
    payload[: payload.numel() - TAIL + COUNT + 1].mul_(count)
    return payload


def pack_sums(first: Tensor, second: Tensor, row: Tensor) -> Tensor:
    """Backward (or empty-input) payload from two per-channel sums, promoted to float64 like the tail."""
    return torch.cat([first, second, row])


def merge(payload: Tensor, num_channels: int, scratch: dict, eps: float, clip: bool) -> Stats:
    """Global mean (relative to the shared shift), ``1 / sqrt`` of the variance it is normalized by (biased
    variance plus eps, or clamped at eps), that variance and the unbiased variance, from a reduced payload.

    Four elementwise ops on the device, none in place on the payload. The first and second moment sums are
    read as ``[[S1, S1], [S2, S2]]`` (a view) and divided by ``[N, N - 1]``: the mean and ``S1 / (N - 1)``
    above ``S2 / N`` (plus eps) and ``S2 / (N - 1)``; subtracting the mean times the row above leaves the
    variances. The shifted sums are exact to float64 rounding, so ``E[(x-K)^2] - E[x-K]^2`` loses
    ``log10((mean - K)^2 / var)`` of float64's 16 digits. ``scratch`` caches the per-device constants.
    """
    c = num_channels
    at = payload.numel() - TAIL + COUNT
    count = payload[at : at + 1]
    key = ("merge", payload.device, eps, clip)
    constants = scratch.get(key)
    if constants is None:  # built on the device: no host-to-device copy
        lowered = torch.zeros((2, 1), dtype=torch.float64, device=payload.device)
        lowered[1] = 1.0  # N, N - 1
        added = torch.zeros((2, 2, 1), dtype=torch.float64, device=payload.device)
        added[1, 0] = 0.0 if clip else eps  # S2 / N + eps: the variance the output is normalized by
        floors = torch.zeros((2, 1), dtype=torch.float64, device=payload.device)
        floors[0] = eps  # that variance is at least eps (its clamp, or >= 0 plus eps); the unbiased >= 0
        constants = scratch[key] = (lowered, added, floors)
    lowered, added, floors = constants
    sums = payload.as_strided((2, 2, c), (c, 0, 1), payload.storage_offset())  # [[S1, S1], [S2, S2]]
    rows = torch.addcdiv(added, sums, torch.sub(count, lowered))
    rows[1].addcmul_(rows[0, 0], rows[0], value=-1).clamp_min_(floors)
    torch.rsqrt(rows[1, 0], out=rows[0, 1])
    return Stats(rows, count)


# The shift: the merge cancels ``log10((mean - K)^2 / var)`` of float64's 16 digits, so K only has to be
# near the call's mean, in units of its standard deviation, and exactly the same on every rank. It is a
# previous global mean, updated from reduced values on the device (no host sync), per channel, by two rules:
# * health: only a call with values (count > 0) and a finite mean and variance moves K, so an empty global
#   batch (0/0) or one NaN/Inf element leaves it where it was, and the next call is as exact as ever;
# * no jumps: a call whose variance exceeds SHIFT_JUMP times the previous healthy call's does not move K
#   (its variance becomes the new reference, so a lasting change moves K one call later). One outlier x
#   among N values moves the mean by x/N but the variance by about x^2/N, so a mean that passes this rule
#   is at most about sqrt(SHIFT_JUMP / N) standard deviations from where the other values are: the outlier
#   (1e10 in one element) costs the next call nothing, where adopting its mean would cost it every digit.
# On the CPU, where reduced values are read anyway, a call whose merge still lost more than REFINE_DIGITS
# (the first call, merged around zero, far from zero; a mean that really jumped) is merged again around its
# own mean: a second all-reduce, decided alike on every rank, so every result keeps float64 accuracy. On
# other devices that would need a host sync: there the first call merges around zero, and the rules above
# keep the later ones accurate.
SHIFT_JUMP = 2.0**10
REFINE_DIGITS = 2.4  # (mean - K)^2 > 2^8 (var + eps)
REFINE = 2.0**8
_INF = float("inf")


def costs_accuracy(mean: Tensor, var: Tensor, eps: float) -> Tensor:
    """Whether some channel's merge (``mean`` relative to K and biased ``var`` from :func:`merge`) lost more
    than ``REFINE_DIGITS`` digits of the variance it is normalized by (a 0-dim bool tensor; NaN never
    counts)."""
    return torch.addcmul(var, mean, mean, value=-1 / REFINE).lt_(-eps).any()


def update_shift(state, mean: Tensor, var: Tensor) -> None:
    """Move ``state.shift`` (K) to this call's global ``mean`` where the rules above allow it.

    ``state.shift_ref`` holds ``SHIFT_JUMP`` times the biased variance ``var`` of the last call with a
    finite one.
    """
    if state.shift is None:
        state.shift = torch.zeros_like(mean)
        state.shift_ref = torch.full_like(var, _INF)
    # A non-finite mean (or an empty call's 0/0) comes with a NaN variance: ``merge`` subtracts inf from
    # inf there. NaN compares False, so this one comparison is the health rule and the jump rule at once.
    adopt = torch.le(var, state.shift_ref)
    state.shift = torch.where(adopt, mean, state.shift)
    state.shift_ref = torch.where(var.lt(_INF), var * SHIFT_JUMP, state.shift_ref)  # var >= 0 or NaN


def running_stat_weight(payload: Tensor, momentum: float | None, out: Tensor, batches: Tensor | None) -> None:
    """Write into every element of ``out`` the weight of this call's running-statistics update, 0 if the call
    was bad, and count the call in ``batches`` (``num_batches_tracked``) only if it was good.

    The guard slot reduces to ``1 - failed - W sum(t^2)`` and ``sum_t (sum t)^2`` is added to it: the
    result is 1 when all ranks sent the same identity and none failed, else at most 0 (Cauchy-Schwarz).
    """
    tail = payload[payload.numel() - TAIL :]
    ident = tail[IDENTITY]
    healthy = torch.addmv(tail[GUARD : GUARD + 1], ident.view(1, -1), ident).gt(0.5)  # (1,) bool
    if batches is not None:
        batches.add_(healthy.view(()))
    healthy = healthy.expand_as(out)  # one weight per element of ``out``
    # bool (x) scalar or int64 computes in float32: exact for float32 buffers; others get out's dtype first
    exact = out.dtype == torch.float32
    if momentum is not None:
        if exact:
            torch.mul(healthy, momentum, out=out)
        else:
            out.copy_(healthy).mul_(momentum)
    else:  # cumulative average: weight 1 / num_batches_tracked (0 before any good call, not 0 / 0)
        count = batches.clamp_min(1)
        torch.div(healthy, count if exact else count.to(out.dtype), out=out)


class Verdict(NamedTuple):
    count: int
    failed: int
    disagreeing: tuple[str, ...]


def verdict(tail: list[float], world_size: int) -> Verdict:
    """What the reduced ``tail`` says about its call (host values, identical on every rank)."""
    ident, squares = tail[IDENTITY], tail[SQUARES]
    for s, sq in zip(ident, squares):  # noqa: B905 - both slices have _FIELDS values
        if s * s != world_size * sq:
            break
    else:
        return Verdict(int(tail[COUNT]), int(tail[FAILED]), ())
    names = {DIRECTION: "direction", CALL: "call count"}
    disagreeing = tuple(
        dict.fromkeys(  # the layer's digits are reported once
            names.get(IDENTITY.start + i, "layer")
            for i, (s, sq) in enumerate(zip(ident, squares, strict=True))
            if s * s != world_size * sq
        )
    )
    return Verdict(int(tail[COUNT]), int(tail[FAILED]), disagreeing)


def raise_for(result: Verdict, tag: CallTag, world_size: int, problem: str | None, training: bool) -> None:
    """Raise the error ``result`` calls for at ``tag``: the same on every rank but the one that failed."""
    if result.disagreeing:
        raise SyncMismatchError(
            f"ranks are out of step at {tag.describe()}: the {world_size} participants disagree on "
            f"{', '.join(result.disagreeing)}. Every rank must call the same synchronized BN layers in the "
            "same order and the same number of times (check data-dependent branches)."
        )
    if result.failed:
        if problem is not None:
            raise ValueError(problem)
        raise SyncError(f"{result.failed} other participant(s) rejected their input at {tag.describe()}")
    if training and result.count == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got 1 over all ranks at {tag.describe()}"
        )
