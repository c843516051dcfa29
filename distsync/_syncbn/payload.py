"""What a synchronized call sends and what it reads back: the payload, shared by every device and transport.

This module builds a call's payload (its moments and its tail), sums it over the participants (a
:class:`Reducer`: a process group here, the replicas of ``nn.DataParallel`` in ``parallel/replica_sync.py``),
merges the reduced one into the global statistics, and reads its verdict; :class:`SyncState` is a layer's
call counts and tail tables. Which path
names a layer is :mod:`distsync._syncbn.identity`'s business; the hash it makes is all the tail holds of it.

A sync payload is one float64 vector per call, the same length in forward and backward so that a rank in
the wrong direction meets a well-formed reduction instead of a size mismatch::

    [ first (C) | second (C) | zeros | tail (TAIL) ]

Its length is a size class (:func:`payload_size`; the tail tables hold the zeros): ``2C + TAIL`` rounded
up to a power of two, at least ``MIN_PAYLOAD``. Ranks out of step at layers of different widths then still
meet equal sizes in most cases (every width up to 120 channels shares the smallest class), and the tail at the
end makes them raise ``SyncMismatchError``; a collective of unequal sizes would abort the process in gloo (and
hang in NCCL). It costs at most twice the bytes of an all-reduce that is bound by its latency anyway.

Forward sends ``first = n (m - K)`` and ``second = n (v + (m - K)^2)`` from this rank's ``n`` values per
channel, their mean ``m`` and biased variance ``v``, around a shift ``K`` that every rank shares (a previous
healthy global mean where accuracy needs it, else zero: see :func:`update_shift`), so the merge ``E[(x-K)^2] -
E[x-K]^2`` cancels only what ``|mean - K|`` makes it cancel. Backward sends the local sums of its gradient
formula.

The tail carries the count, a rejected-input flag and the call identity
folded so that every rank reaches the same verdict from the same reduced numbers without reading them:
:func:`running_stat_weight` turns the verdict into the weight of the running-statistics update on the
device, and :func:`verdict` decodes it on the host when the numbers are read.

Every call adds ``[layer (4 digits), direction, call]`` and their squares to the payload tail: after a
SUM over W participants, ``(sum t)^2 == W sum(t^2)`` for each field iff all sent the same value. The values
are kept below a modulus ``m`` with ``6 (W m)^2 < 2^53``, so float64 holds every term exactly; the layer
hash is written as four base-``m`` digits (all 64 bits for ``m >= 2^16``, i.e. up to 590 ranks).

Tails live on the device in small per-layer tables (a block of consecutive calls per direction), so a call
selects its tail as a view: no host-to-device copy per call.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from distsync import _torch_compat
from distsync.errors import SyncError, SyncMismatchError

# Tail slots: [count | failed | layer digits (4), direction, call | their squares | guard].
COUNT, FAILED = 0, 1
LAYER_DIGITS = 4
LAYER, DIRECTION, CALL = 2, 2 + LAYER_DIGITS, 3 + LAYER_DIGITS
_FIELDS = LAYER_DIGITS + 2
IDENTITY, SQUARES = slice(2, 2 + _FIELDS), slice(2 + _FIELDS, 2 + 2 * _FIELDS)
GUARD = 2 + 2 * _FIELDS
TAIL = GUARD + 1
FORWARD, BACKWARD = 0, 1
_DIRECTIONS = ("forward", "backward")
_BLOCK = 64  # calls per tail table
_EXACT = 2**53 / _FIELDS  # (W m)^2 must stay below this
MAX_WORLD_SIZE = int(_EXACT**0.5) // _BLOCK


MIN_PAYLOAD = 256


def payload_size(num_channels: int) -> int:
    """Length of a sync payload for ``num_channels`` channels: ``2C + TAIL`` rounded up to its size class,
    a power of two of at least ``MIN_PAYLOAD`` (see this module's docstring)."""
    return max(MIN_PAYLOAD, 1 << (2 * num_channels + TAIL - 1).bit_length())


@functools.cache
def call_modulus(world_size: int) -> int:
    """Largest multiple of the table block (at most 2^20) with ``6 (W m)^2 < 2^53``."""
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"distsync's exact desync check supports at most {MAX_WORLD_SIZE} participants per "
            f"synchronized layer, got {world_size}; sync within smaller process groups"
        )
    bound = int((_EXACT**0.5) / world_size)
    return min(1 << 20, bound - bound % _BLOCK)


class CallTag(NamedTuple):
    """Which layer, direction and call of that layer a payload belongs to (identical on every rank)."""

    layer_id: int
    direction: int
    call: int
    layer_name: str

    def describe(self) -> str:
        return f"{self.layer_name}, {_DIRECTIONS[self.direction]} call #{self.call}"


# Slots through which a wrapper holds the module it wraps: not part of a path.

_BUILT = itertools.count()  # synchronized layers built in this process, in order


_Kept = TypeVar("_Kept")


class Scratch(dict):
    """A layer's small tensors reused call after call (per-device constants and buffers), by key."""

    def kept(self, key, make: Callable[[], _Kept]) -> _Kept:
        """``self[key]``, made by ``make()`` at the first call that needs it, outside inference mode: a first
        call made under ``torch.inference_mode()`` (a train-mode pass that recalibrates the running
        statistics) then leaves tensors that later training calls may update in place and save for
        backward, as ``nn.BatchNorm`` leaves its buffers."""
        value = self.get(key)
        if value is None:
            with torch.inference_mode(False):
                value = self[key] = make()
        return value


class SyncState:
    """A synchronized layer's identity, call counts and device-side tails, plus its merge shift.

    Copies start with fresh counts and no cached tensors, and keep the path stamp and explicit name. A
    deep copy also counts one more generation (``copies``), so a teacher copied from a student never
    passes for it in the desync check; an unpickled layer counts as built (``copies == 0``), so a model
    loaded whole on one rank matches the model built on another.
    """

    def __init__(
        self,
        layer_name: str = "",
        copies: int = 0,
        path: str | None = None,
        name: str | None = None,
        built: int | None = None,
    ) -> None:
        self.layer_name = layer_name  # for messages, once the identity is known
        self.copies = copies  # deep copies between this layer and one built or unpickled
        self.path = path  # stamped by conversion or at the first call; kept by pickles and copies
        self.name = name  # explicit name (name_layers), preferred to any path
        self.built = next(_BUILT) if built is None else built  # the name of a layer with no path
        self.identity: int | None = None
        self.calls = [0, 0]
        self.shift: Tensor | None = None  # merge shift (float64), shared by every rank
        self.shift_ref: Tensor | None = None  # variance of the call the shift was judged against
        self._tables: dict = {}
        self.scratch = Scratch()
        self.join = None  # the reducer of the Join the layer is in (distsync.join), never copied
        self.transport = None  # (process group, its reducer) of the last call, never copied

    def __deepcopy__(self, memo) -> SyncState:
        return SyncState(self.layer_name, self.copies + 1, self.path, self.name, self.built)

    def __getstate__(self) -> dict:
        return {"layer_name": self.layer_name, "path": self.path, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.get("layer_name", ""), 0, state.get("path"), state.get("name"))

    def fresh_copy(self) -> SyncState:
        """Same identity and counts, own tables (for a replica that syncs on its own)."""
        copy = SyncState(self.layer_name, self.copies, self.path, self.name, self.built)
        copy.identity, copy.calls = self.identity, list(self.calls)
        return copy

    def next_tag(self, direction: int) -> CallTag:
        call = self.calls[direction]
        self.calls[direction] = call + 1
        return CallTag(self.identity or 0, direction, call, self.layer_name or "synchronized BN layer")

    def tail(self, tag: CallTag, world_size: int, first: bool, device: torch.device, width: int) -> Tensor:
        """The end of call ``tag``'s payload for ``width`` channels: the zeros that pad it to its size class,
        then the tail (count slot 1 in forward, else 0). A view into a device table: no copy per call."""
        modulus = call_modulus(world_size)
        call = tag.call % modulus
        key = (tag.direction, world_size, first, device, width)
        block, table = self._tables.get(key, (None, None))
        if block != call // _BLOCK:
            block = call // _BLOCK
            digits = [(tag.layer_id // modulus**i) % modulus for i in range(LAYER_DIGITS)]
            table = _tail_table(digits, tag.direction, block * _BLOCK, world_size, first, device)
            pad = payload_size(width) - 2 * width - TAIL
            table = torch.cat([table.new_zeros(_BLOCK, pad), table], dim=1)
            self._tables[key] = (block, table)
        return table[call % _BLOCK]


def _tail_table(
    digits: list[int], direction: int, start: int, world_size: int, first: bool, device
) -> Tensor:
    """Tails of ``_BLOCK`` consecutive calls, built on the device from host scalars (no copy)."""
    calls = torch.arange(start, start + _BLOCK, dtype=torch.float64, device=device)
    constant = calls.new_zeros(()).expand(_BLOCK)
    squares = calls * calls
    fixed = [*digits, direction]
    fixed_squares = float(sum(v * v for v in fixed))
    guard = torch.add(squares, fixed_squares).mul_(-world_size).add_(1.0 if first else 0.0)
    columns = [
        constant + (1.0 if direction == FORWARD else 0.0),
        constant,
        *(constant + float(v) for v in fixed),
        calls,
        *(constant + float(v * v) for v in fixed),
        squares,
        guard,
    ]
    return torch.stack(columns, dim=1)


def failed_row(row: Tensor) -> Tensor:
    """``row`` for a participant that rejected its input: failed set, guard lowered, count 0."""
    failed = row.clone()
    tail = failed[failed.numel() - TAIL :]
    tail[COUNT] = 0.0
    tail[FAILED] = 1.0
    tail[GUARD] -= 1.0
    return failed


class Stats(NamedTuple):
    """Global statistics of one forward sync on a device: float64 rows of one ``(2, 2, C)`` tensor,
    ``[[mean, invstd], [var, unbiased var]]`` (``var`` is the biased variance plus eps, or the variance
    clamped at eps: what ``invstd`` is the inverse square root of), see :func:`merge`, and a view of each
    of its four rows."""

    rows: Tensor
    count: Tensor  # (1,) float64 view of the global count, on the device
    mean: Tensor
    invstd: Tensor
    var: Tensor
    unbiased: Tensor

    @classmethod
    def of(cls, rows: Tensor, count: Tensor) -> Stats:
        """The statistics held in ``rows`` (a copy of a merge's, for a checkpoint's recomputation)."""
        (mean, invstd), (var, unbiased) = (row.unbind() for row in rows.unbind())
        return cls(rows, count, mean, invstd, var, unbiased)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the statistics used to normalize an input of ``dtype``: float32 at least."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack_moments(
    mean: Tensor, var: Tensor, count: int, row: Tensor, deviation: Tensor | None = None
) -> Tensor:
    """Forward payload from this rank's per-channel ``mean`` and biased ``var`` of ``count`` values.

    ``deviation`` is this rank's mean minus the shared shift K, in float64, where the caller computed it
    (around a shift, or from moments about an origin); None where ``mean`` is that itself (K = 0).
    ``row`` is the call's padded tail; its count slot holds 1 and becomes ``count`` here.
    """
    c = mean.numel()
    if deviation is None:  # cat promotes mean and var to float64 (exactly); v + d^2 in float64
        payload = torch.cat([mean, var, row])
        d = payload[:c]
        payload[c : 2 * c].addcmul_(d, d)
    else:
        payload = torch.cat([deviation, torch.addcmul(var, deviation, deviation), row])
    payload[: payload.numel() - TAIL + COUNT + 1].mul_(count)
    return payload


def pack_sums(first: Tensor, second: Tensor, row: Tensor) -> Tensor:
    """Backward (or empty-input) payload from two per-channel sums, promoted to float64 like the tail."""
    return torch.cat([first, second, row])


def merge(payload: Tensor, num_channels: int, scratch: Scratch, eps: float, clip: bool) -> Stats:
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
    lowered, added, floors = scratch.kept(
        ("merge", payload.device, eps, clip), lambda: _merge_constants(payload.device, eps, clip)
    )
    sums = payload.as_strided((2, 2, c), (c, 0, 1), payload.storage_offset())  # [[S1, S1], [S2, S2]]
    rows = torch.addcdiv(added, sums, torch.sub(count, lowered))
    top, bottom = rows.unbind()  # [mean, S1 / (N - 1)] and [S2 / N (+ eps), S2 / (N - 1)]
    (mean, invstd), (var, unbiased) = top.unbind(), bottom.unbind()
    bottom.addcmul_(top, mean, value=-1).clamp_min_(floors)
    torch.rsqrt(var, out=invstd)
    return Stats(rows, count, mean, invstd, var, unbiased)


def _merge_constants(device: torch.device, eps: float, clip: bool) -> tuple[Tensor, Tensor, Tensor]:
    """What :func:`merge` lowers the count by, adds and clamps at, built on the device (no host copy)."""
    lowered = torch.zeros((2, 1), dtype=torch.float64, device=device)
    lowered[1] = 1.0  # N, N - 1
    added = torch.zeros((2, 2, 1), dtype=torch.float64, device=device)
    added[1, 0] = 0.0 if clip else eps  # S2 / N + eps: the variance the output is normalized by
    floors = torch.zeros((2, 1), dtype=torch.float64, device=device)
    floors[0] = eps  # that variance is at least eps (its clamp, or >= 0 plus eps); the unbiased >= 0
    return lowered, added, floors


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


def costs_accuracy(mean: Tensor, var: Tensor) -> Tensor:
    """Whether some channel's merge (``mean`` relative to K and biased ``var`` from :func:`merge`, eps
    included) lost more than ``REFINE_DIGITS`` digits of the variance it is normalized by (a 0-dim bool
    tensor; NaN never counts)."""
    return torch.addcmul(var, mean, mean, value=-1 / REFINE).lt_(0).any()


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


def agreed(tail: Tensor) -> Tensor:
    """Whether every rank sent the same identity and none failed, from a reduced tail, on its device (a
    ``(1,)`` bool tensor). The guard slot reduces to ``1 - failed - W sum(t^2)`` and ``sum_t (sum t)^2`` is
    added to it: the result is 1 when all ranks sent the same identity and none failed, else at most 0
    (Cauchy-Schwarz)."""
    ident = tail[IDENTITY]
    return torch.addmv(tail[GUARD : GUARD + 1], ident.view(1, -1), ident).gt(0.5)


def running_stat_weight(payload: Tensor, momentum: float | None, out: Tensor, batches: Tensor | None) -> None:
    """Write into every element of ``out`` the weight of this call's running-statistics update, 0 if the call
    was bad (:func:`agreed`), and count the call in ``batches`` (``num_batches_tracked``) only if it was
    good."""
    healthy = agreed(payload[payload.numel() - TAIL :])
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
        # a rank that rejected its input may have sent in place of another call (a compiled graph's)
        rejected = f" {result.failed} of them had rejected their input." if result.failed else ""
        raise SyncMismatchError(
            f"ranks are out of step at {tag.describe()}: the {world_size} participants disagree on "
            f"{', '.join(result.disagreeing)}.{rejected} Every rank must call the same synchronized BN "
            "layers in the same order and the same number of times (check data-dependent branches)."
        )
    if result.failed:
        if problem is not None:
            raise ValueError(problem)
        raise SyncError(f"{result.failed} other participant(s) rejected their input at {tag.describe()}")
    if training and result.count == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got 1 over all ranks at {tag.describe()}"
        )


# ------------------------------------------------------------------------------------- the transports
# What sums a payload over everyone sharing a batch-norm layer's statistics.


class Call(NamedTuple):
    """A synchronized call as a rank without a batch needs it to take part (see :mod:`distsync.join`)."""

    direction: int  # FORWARD or BACKWARD
    state: SyncState  # the layer's: its identity
    channels: int
    dtype: torch.dtype  # the input's (forward)
    momentum: float | None = None
    eps: float = 0.0
    running_mean: Tensor | None = None  # the running statistics the call updates (None: none)
    running_var: Tensor | None = None
    counts: bool = False  # the call counts the batch in the layer's num_batches_tracked (else its caller did)


class Reducer(Protocol):
    """Sums a tensor over all participants; every participant gets the same result."""

    world_size: int
    first: bool  # exactly one participant is first

    def all_reduce(self, payload: Tensor) -> Tensor: ...

    def announce(self, call: Call) -> None:
        """Say that ``call``'s all-reduce comes next, to participants who cannot know (ranks that joined
        under DDP's ``Join``); a no-op for the others."""


class ProcessGroupReducer:
    """One ``all_reduce(SUM)`` on a ``torch.distributed`` process group."""

    def __init__(self, process_group: dist.ProcessGroup | None, world_size: int) -> None:
        self.process_group = process_group
        self.world_size = world_size
        self.first = dist.get_rank(process_group) == 0

    @property
    def timeout(self) -> float | None:
        """How long a collective of the group may wait for a peer, in seconds (None if unknown)."""
        return _torch_compat.process_group_timeout(self.process_group)

    def all_reduce(self, payload: Tensor) -> Tensor:
        dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.process_group)
        return payload

    def announce(self, call: Call) -> None:
        """Every participant makes every call itself: nothing to say."""


def process_group_reducer(process_group: dist.ProcessGroup | None) -> ProcessGroupReducer | None:
    """A reducer over ``process_group`` (default group if None), or None when there is nobody to sync with."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(process_group)
    if world_size <= 1:
        return None
    return ProcessGroupReducer(process_group, world_size)
