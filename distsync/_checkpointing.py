"""The statistics of recent synchronized calls, for activation checkpointing's recomputation.

``torch.utils.checkpoint`` (reentrant or not) runs a segment's forward again during backward, to rebuild
what it did not keep. A synchronized layer in it would all-reduce a second time and move its running
statistics twice. Instead each call keeps its global statistics (``3C + 1`` numbers) here, and a forward
made inside backward takes them back: the same output, bit for bit, and no collective. Every rank
recomputes the same calls, so all of them skip the all-reduce alike.

A recomputed call is matched with its original by the input's shape, dtype and device, and where a layer
made several such calls, by its local moments, which a recomputation reproduces exactly (compared on the
device, without a host read). A layer keeps its last ``KEPT_CALLS`` calls; an older one is all-reduced
again (consistently on every rank: all of them keep the same calls).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._moments import Stats


class Kept(NamedTuple):
    key: tuple
    mean: Tensor  # the call's local moments (references: nothing is copied for a call that is not
    var: Tensor  # recomputed)
    stats: Stats


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: a checkpointed segment being recomputed."""
    if torch.compiler.is_compiling():  # compiled code recomputes under its own rules (nothing is kept)
        return False
    return torch._C._current_graph_task_id() != -1


def keep(state, input: Tensor, local, stats: Stats) -> None:
    """Keep a call's global statistics, which nothing changes after the call (the kernels normalize with
    copies of them)."""
    if local is not None:
        state.kept.append(Kept(_key(input), local.mean, local.var, stats))


def find(state, input: Tensor, local, host_reads: bool) -> Stats | None:
    """The kept statistics of the call a recomputation repeats, or None (then it all-reduces again).
    Without ``host_reads`` (devices whose values are not read at the call) the match is chosen on the
    device."""
    key = _key(input)
    candidates = [kept for kept in state.kept if kept.key == key]
    if len(candidates) <= 1:  # normalizing may work on the rows in place: hand out a copy
        return Stats(candidates[0].stats.rows.clone(), candidates[0].stats.count) if candidates else None
    if host_reads:
        same = (
            k.stats for k in candidates if torch.equal(k.mean, local.mean) and torch.equal(k.var, local.var)
        )
        found = next(same, None)
        return found and Stats(found.rows.clone(), found.count)
    fingerprint = torch.cat([local.mean, local.var])
    table = torch.stack([torch.cat([k.mean, k.var]) for k in candidates])
    matches = (table == fingerprint).all(1)
    index = matches.to(torch.int32).argmax()  # the first match, chosen on the device
    rows = torch.stack([k.stats.rows for k in candidates])[index]
    count = torch.stack([k.stats.count for k in candidates])[index]
    return Stats(rows, count)


def _key(input: Tensor) -> tuple:
    return tuple(input.shape), input.dtype, input.device
