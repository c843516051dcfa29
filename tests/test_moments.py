"""Bad batches do not poison a layer: its merge shift only moves on healthy calls, and results stay exact.

Every number is compared with float64 ``nn.BatchNorm`` on the global batch (all ranks' inputs stacked).
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import distsync
from distsync._syncbn.payload import SHIFT_JUMP, SyncState, update_shift
from distsync.testing import run_world

PER_RANK = 3


def _global_batches(steps: int, world_size: int, bad: dict, dtype, channels=3):
    """Global batches ``(world_size * PER_RANK, C, 4)``; ``bad[step]`` edits one or returns another."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        x = torch.randn(world_size * PER_RANK, channels, 4, generator=gen, dtype=torch.float64) * 2 + 3
        batches.append(bad[step](x) if step in bad else x)
    return [x.to(dtype) for x in batches]


def _per_rank(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = x.shape[0] // world_size
    return x[rank * size : (rank + 1) * size]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0 if actual.numel() == 0 else math.inf
    if not actual.isfinite().all():
        return math.inf
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _nan_at_rank0(x):
    x[0, 1, 2] = float("nan")
    return x


def _inf_at_rank0(x):
    x[1, 0, 0] = float("inf")
    return x


def _outlier_at_rank0(x):
    x[0, 0, 0] = 1e10
    return x


SCENARIOS = {
    "empty": {1: lambda x: x[:0]},
    "nan": {1: _nan_at_rank0},
    "inf": {1: _inf_at_rank0},
    "outlier": {1: _outlier_at_rank0},
}


def _bad_then_normal(rank, world_size, dtype):
    """Per scenario and step: relative output error vs float64 nn.BatchNorm, and all-reduces per call."""
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(1)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        results = {}
        for name, bad in SCENARIOS.items():
            layer = distsync.DistSyncBatchNorm1d(3, dtype=dtype)
            reference = nn.BatchNorm1d(3, dtype=torch.float64)
            errors, reduces = [], []
            for x in _global_batches(5, world_size, bad, dtype):
                calls.clear()
                out = layer(_per_rank(x, rank, world_size))
                reduces.append(len(calls))
                errors.append(_relative_error(out, _per_rank(reference(x.double()), rank, world_size)))
            running = [
                _relative_error(layer.running_mean, reference.running_mean),
                _relative_error(layer.running_var, reference.running_var),
            ]
            results[name] = errors, reduces, running
        return results
    finally:
        dist.all_reduce = original


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_bad_call_does_not_poison_the_next_ones(dtype):
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    for results in run_world(_bad_then_normal, 2, dtype):
        for name, (errors, reduces, running) in results.items():
            # The normal calls before and after the bad one are exact to rounding...
            assert max(errors[:1] + errors[2:]) < tolerance, (name, errors)
            # ...with one all-reduce each: the shift kept away from the bad call needs no second merge.
            assert reduces[2:] == [1, 1, 1], (name, reduces)
            if name in ("empty", "outlier"):  # finite running statistics, those of nn.BatchNorm
                assert errors[1] < tolerance and max(running) < tolerance, (name, errors, running)


def _skip_step_loop(rank, world_size, steps, bad_step):
    """A DDP loop that skips the optimizer step when the loss is not finite (what GradScaler does)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)).double()
    if world_size > 1:
        net = DistributedDataParallel(distsync.convert_sync_batchnorm(net))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    pattern, losses = "", []
    for step in range(steps):
        x = torch.randn(4 * max(world_size, 2), 3, generator=gen, dtype=torch.float64)
        if step == bad_step:
            x[0, 0] = float("nan")
        if world_size > 1:
            x = _per_rank(x, rank, world_size)
        optimizer.zero_grad()
        loss = net(x).square().mean()
        loss.backward()
        if not loss.isfinite():
            pattern += "S"
            continue
        optimizer.step()
        pattern += "."
        losses.append(loss.item())
    return pattern, losses


def test_a_nan_step_is_skipped_once_as_with_nn_batchnorm():
    expected_pattern, expected_losses = _skip_step_loop(0, 1, 8, 2)
    assert expected_pattern == "..S....."
    per_rank = run_world(_skip_step_loop, 2, 8, 2)
    assert [pattern for pattern, _ in per_rank] == [expected_pattern] * 2
    # each rank's loss is the mean over its half of the global batch: their mean is the reference loss
    mean_losses = [(a + b) / 2 for a, b in zip(per_rank[0][1], per_rank[1][1], strict=True)]
    assert max(abs(a - b) for a, b in zip(mean_losses, expected_losses, strict=True)) < 1e-12


def test_shift_rules_without_a_world():
    """The shift moves only to healthy means whose variance did not jump (the device path's only guard)."""
    state = SyncState()

    def call(mean, var):
        update_shift(state, *torch.tensor([[mean], [var]], dtype=torch.float64))
        return state.shift.item()

    assert call(5.0, 1.0) == 5.0
    assert call(float("nan"), float("nan")) == 5.0  # empty global batch (0/0)
    assert call(float("inf"), float("nan")) == 5.0  # an Inf element
    assert call(1e8, 1e18) == 5.0  # an outlier: the variance jumped
    assert call(6.0, 1.0) == 6.0  # back to normal: adopted
    assert call(1e3, 4.0 * SHIFT_JUMP) == 6.0  # a lasting change of scale...
    assert call(1e3 + 1, 4.0 * SHIFT_JUMP) == 1e3 + 1  # ...is adopted one call later


def test_payload_size_classes():
    """Every width up to 120 channels shares one size; above, a class costs at most twice the bytes."""
    from distsync._syncbn.payload import MIN_PAYLOAD, TAIL, payload_size

    assert {payload_size(c) for c in range(1, 121)} == {MIN_PAYLOAD}
    for c in range(1, 5000, 7):
        assert 2 * c + TAIL <= payload_size(c) <= max(MIN_PAYLOAD, 2 * (2 * c + TAIL))


def test_shift_rules_never_read_device_values():
    """On a device (meta here: reading a value raises) the shift moves without any host sync."""
    state = SyncState()
    rows = torch.empty(3, 4, dtype=torch.float64, device="meta")
    for _ in range(2):
        update_shift(state, rows[0], rows[1])
    assert state.shift.device.type == "meta" and state.shift_ref.device.type == "meta"
