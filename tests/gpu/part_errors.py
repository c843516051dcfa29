"""Part 5: an error decided on one rank is raised on every rank, at the documented call.

Two ranks share the device over gloo. On a GPU the verdicts are read back without stalling: an out-of-step
call raises 8 to 15 synchronized calls after it, at the same call on every rank, and at the latest at
``distsync.check_sync()`` (docs/performance.md); the rank whose own input was rejected raises at once. On the
CPU (the dry run) every rank raises at the call itself.
"""

from __future__ import annotations

import torch
from common import Findings, rank_device

import distsync
from distsync.testing import run_world

BAD_CALL = 3  # the call at which rank 1 syncs the other layer
CALLS = 30


def _outcome(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001  the check compares what each rank raised
        return type(error).__name__, str(error).splitlines()[0]
    return None


def run(findings: Findings, device: str) -> None:
    on_gpu = device == "cuda"
    first, second = run_world(_out_of_step, 2, device, timeout=120)
    findings.check(
        "out of step: both ranks raise SyncMismatchError at the same call",
        first[0] == second[0] and first[1] == second[1] == "SyncMismatchError",
        f"rank 0 at call {first[0]}, rank 1 at call {second[0]}: {first[2]}",
    )
    window = (BAD_CALL + 8, BAD_CALL + 15) if on_gpu else (BAD_CALL, BAD_CALL)
    findings.check(
        f"out of step: raised at call {window[0]}..{window[1]} (bad call {BAD_CALL})",
        window[0] <= first[0] <= window[1],
        f"call {first[0]}",
    )
    findings.figure("out of step: calls between the bad call and the error", first[0] - BAD_CALL)

    (at0, later0, good0, state0), (at1, later1, good1, state1) = run_world(_rejected, 2, device, timeout=120)
    findings.check(
        "rejected input: the rank with the bad input raises ValueError at its call",
        at1 is not None and at1[0] == "ValueError" and "channels" in at1[1],
        str(at1),
    )
    where = later0 if on_gpu else at0
    findings.check(
        "rejected input: the other rank raises SyncError " + ("at check_sync()" if on_gpu else "at the call"),
        where is not None and where[0] == "SyncError" and "rejected" in where[1],
        f"at the call: {at0}; at check_sync(): {later0}",
    )
    findings.check(
        "rejected input: both ranks go on in step; the bad call moved no statistics",
        good0 is None and good1 is None and state0 == state1 and state0[0] == 2,
        f"next call: {good0} / {good1}; num_batches_tracked {state0[0]} / {state1[0]}",
    )

    outcomes = run_world(_single_value, 2, device, timeout=120)
    findings.check(
        "one value per channel over all ranks: ValueError on both ranks",
        outcomes[0] == outcomes[1] and outcomes[0] is not None and "more than 1 value" in outcomes[0][1],
        str(outcomes[0]),
    )


def _out_of_step(rank: int, world_size: int, device: str) -> tuple[int, str, str]:
    """Two layers of one width; at call ``BAD_CALL`` rank 1 syncs the other one. (call index, error)"""
    place = rank_device(device, rank)
    model = torch.nn.Sequential(distsync.DistSyncBatchNorm1d(4), distsync.DistSyncBatchNorm1d(4)).to(place)
    for index in range(CALLS):
        which = 1 if (index == BAD_CALL and rank == 1) else 0
        outcome = _outcome(lambda: model[which](torch.randn(6, 4, device=place)))  # noqa: B023
        if outcome is not None:
            return index, *outcome
    outcome = _outcome(distsync.check_sync)
    return CALLS, *(outcome or ("nothing raised", ""))


def _rejected(rank: int, world_size: int, device: str):
    """Rank 1 gives the wrong channel count at the second call."""
    place = rank_device(device, rank)
    torch.manual_seed(0)
    layer = distsync.DistSyncBatchNorm2d(3, momentum=None).to(place)
    layer(torch.randn(4, 3, 2, 2, device=place)).sum().backward()
    distsync.check_sync()
    x = torch.randn(4, 3 if rank == 0 else 5, 2, 2, device=place)
    at_call = _outcome(lambda: layer(x))
    later = _outcome(distsync.check_sync)
    good = _outcome(lambda: layer(torch.randn(4, 3, 2, 2, device=place)))
    distsync.check_sync()
    return at_call, later, good, (int(layer.num_batches_tracked), layer.running_var.cpu().tolist())


def _single_value(rank: int, world_size: int, device: str):
    place = rank_device(device, rank)
    layer = distsync.DistSyncBatchNorm1d(3).to(place)

    def train_step() -> None:
        layer(torch.randn(1 - rank, 3, device=place)).sum().backward()
        distsync.check_sync()

    return _outcome(train_step)
