"""Statistics as accurate as nn.BatchNorm's, at every size and dtype, on the CPU and the generic path.

Each case runs a training step twice (fresh data each time) through the synchronized layer and through
single-process ``nn.BatchNorm2d``, both on the same values, and compares each with float64 BN on the global
batch: outputs and input gradients at every step, running statistics after the last. The layer's relative
error must be within twice ``nn.BatchNorm2d``'s plus a floor: a quarter of float32's rounding unit for
outputs and gradients, one unit for the running statistics, which are stored in float32 at best (a handful
of numbers, each rounded a few times by either layer: which one is luckier is chance). Sizes are values per
channel per rank; in the 2-rank worlds each rank holds one such batch and the references see both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from torch import nn

import distsync
from distsync._syncbn import kernels as _kernels
from distsync.testing import run_world

FLOOR = 2.0**-26
RUNNING_FLOOR = 2.0**-24  # running statistics are stored in float32 at best: one rounding each
HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Case:
    """A per-rank batch of ``shape`` whose channels have standard deviations around ``std``."""

    shape: tuple[int, ...]  # (N, C, H, W) per rank
    dtype: torch.dtype = torch.float32
    std: float = 1.0
    module_dtype: torch.dtype = torch.float32  # parameters and running statistics
    generic: bool = False  # through GenericKernels, the path of devices other than the CPU and CUDA
    channels_last: bool = False
    steps: int = 2  # training calls: the second one normalizes around the first one's mean (the CPU's shift)

    def describe(self) -> str:
        per_channel = math.prod(self.shape) // self.shape[1]
        flags = [
            f"{per_channel} per channel",
            str(self.dtype).removeprefix("torch."),
            f"std {self.std:g}",
            f"module {str(self.module_dtype).removeprefix('torch.')}",
            "generic" if self.generic else "",
            "channels_last" if self.channels_last else "",
        ]
        return f"{self.shape} " + ", ".join(f for f in flags if f)


class _OneRank:
    """A reducer of one participant: the synchronized path in one process (the layer alone is plain BN)."""

    world_size, first = 1, True

    def all_reduce(self, payload: torch.Tensor) -> torch.Tensor:
        return payload

    def announce(self, call) -> None:  # nobody joined to tell
        pass


def _batch(case: Case, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step in ``case.dtype`` (every rank's, stacked) and its output gradient."""
    gen = torch.Generator().manual_seed(step)
    n, c, *spatial = case.shape
    x = torch.randn(n * world_size, c, *spatial, generator=gen)
    stds = case.std * (0.5 + torch.rand(c, generator=gen))
    x.mul_(stds.view(1, -1, *[1] * len(spatial)))
    return x.to(case.dtype), torch.randn(x.shape, generator=gen).to(case.dtype)


def _relative(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """``|actual - expected| / |scale|`` (``scale`` defaults to ``expected``, float64); inf or NaN if
    ``actual`` holds a non-finite value."""
    scale = expected if scale is None else scale
    return (torch.linalg.vector_norm(actual.detach().double() - expected) / scale.norm()).item()


def _stored(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """:func:`_relative` for running statistics: entries that ``expected`` overflows to in ``actual``'s
    dtype (a variance beyond fp16's range) must hold that inf, as ``nn.BatchNorm``'s do, and are left out."""
    overflow = expected.to(actual.dtype).isinf()
    if not torch.equal(actual.isinf() & overflow, overflow):
        return math.inf
    keep = ~overflow
    if not keep.any():
        return 0.0
    return _relative(actual[keep], expected[keep], None if scale is None else scale[keep])


def _errors(case: Case, world_size: int, rank: int, synced: bool) -> dict[str, float]:
    """Worst relative errors, by quantity, of ``rank``'s share of the global batch: through the layer on
    ``rank`` (``synced``), or through single-process ``nn.BatchNorm2d`` on the whole global batch."""
    channels = case.shape[1]
    gen = torch.Generator().manual_seed(channels)
    weight, bias = torch.rand(channels, generator=gen) + 0.5, torch.randn(channels, generator=gen)
    reference = nn.BatchNorm2d(channels).double()
    if synced:
        layer = distsync.DistSyncBatchNorm2d(channels, dtype=case.module_dtype)
        if world_size == 1:
            layer._replica_reducer = _OneRank()
    else:
        layer = nn.BatchNorm2d(channels, dtype=case.module_dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
        reference.weight.copy_(layer.weight)
        reference.bias.copy_(layer.bias)
    share = slice(rank * case.shape[0], (rank + 1) * case.shape[0])
    errors: dict[str, float] = {}
    for step in range(case.steps):
        x, dy = _batch(case, world_size, step)
        ref_x = x.double().requires_grad_()
        ref_out = reference(ref_x)
        ref_out.backward(dy.double())
        if synced:  # the layer sees this rank's share, nn.BatchNorm2d the whole batch as one process would
            x, dy = x[share], dy[share]
            if case.channels_last:  # (nn.BatchNorm2d keeps its more accurate contiguous layout)
                x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
        x.requires_grad_()
        out = layer(x)
        out.backward(dy)
        mine = slice(None) if synced else share
        for name, found, expected in (("output", out, ref_out), ("input grad", x.grad, ref_x.grad)):
            error = _relative(found[mine], expected.detach()[share])
            errors[name] = max(errors.get(name, 0.0), error)
    spread = reference.running_var.sqrt()  # the running mean's error in units of the standard deviation
    errors["running_mean"] = _stored(layer.running_mean, reference.running_mean, spread)
    errors["running_var"] = _stored(layer.running_var, reference.running_var)
    return errors


def _world_errors(rank: int, world_size: int, cases: list[Case]) -> list[tuple[dict, dict]]:
    """Per case, this rank's errors through the layer and through nn.BatchNorm2d (on the same rows)."""
    found = []
    for case in cases:
        with _kernels.routed("cpu", _kernels.GenericKernels) if case.generic else contextlib.nullcontext():
            synced = _errors(case, world_size, rank, synced=True)
        found.append((synced, _errors(case, world_size, rank, synced=False)))
    return found


def _check(cases: list[Case], per_rank: list[list[tuple[dict, dict]]]) -> None:
    """Each rank's errors within twice nn.BatchNorm2d's on the same rows, plus the floors."""
    failures = []
    for rank, found in enumerate(per_rank):
        for case, (errors, baseline) in zip(cases, found, strict=True):
            for name, error in errors.items():
                floor = RUNNING_FLOOR if name.startswith("running") else FLOOR
                if not error <= 2 * baseline[name] + floor:
                    failures.append(
                        f"rank {rank}/{len(per_rank)} {case.describe()}: {name} {error:.2e} "
                        f"(nn.BatchNorm2d {baseline[name]:.2e})"
                    )
    assert not failures, "\n".join(failures)


HALF_CASES = [
    Case((8, 4, 16, 16), dtype, std, module_dtype)
    for dtype in HALF
    for std in (300.0, 2000.0)
    for module_dtype in (torch.float32, dtype)
]
GENERIC_HALF_CASES = [
    Case((8, 4, 16, 16), torch.float16, 2000.0, module_dtype, generic=True)
    for module_dtype in (torch.float32, torch.float16)
]
SIZES = {"16k": (4, 8, 64, 64), "1M": (4, 4, 512, 512), "4M": (4, 2, 1024, 1024)}
STEPS = {"16k": 2, "1M": 1, "4M": 1}  # one call where a second would make the test slow


def test_half_inputs_one_process():
    """fp16/bf16 inputs whose variance exceeds fp16's range: statistics in float32, finite and exact."""
    cases = HALF_CASES + GENERIC_HALF_CASES
    _check(cases, [_world_errors(0, 1, cases)])


def test_half_inputs_two_ranks():
    cases = HALF_CASES + GENERIC_HALF_CASES
    _check(cases, run_world(_world_errors, 2, cases))


@pytest.mark.parametrize("size", SIZES)
def test_float32_one_process(size):
    cases = [Case(SIZES[size], steps=STEPS[size])]
    if size != "4M":
        cases.append(Case(SIZES[size], generic=True, steps=STEPS[size]))
    if size == "1M":
        cases.append(Case(SIZES[size], channels_last=True, steps=STEPS[size]))
    _check(cases, [_world_errors(0, 1, cases)])


@pytest.mark.parametrize("size", SIZES)
def test_float32_two_ranks(size):
    cases = [Case(SIZES[size], steps=STEPS[size])]
    if size == "16k":
        cases.append(Case(SIZES[size], generic=True, steps=STEPS[size]))
    _check(cases, run_world(_world_errors, 2, cases))


LAYOUTS = [  # (shape, memory format, cut into blocks): every branch of kernels.blocks
    ((2, 3), None, False),  # 2D, short: one block per channel
    ((2000, 5), None, True),  # 2D: blocks of rows
    ((4, 3, 7), None, False),  # short planes
    ((4, 3, 1000), None, True),  # 1D planes cut into runs
    ((3, 2, 1021), None, False),  # a prime plane length: one run
    ((4, 3, 64, 64), None, True),
    ((4, 3, 64, 64), torch.channels_last, True),
    ((2, 3, 5, 33, 33), None, True),
    ((2, 3, 5, 33, 33), torch.channels_last_3d, True),
    ((1, 3, 4, 1024), None, True),  # one sample: no rows to group
    ((8, 3, 7, 7), torch.channels_last, False),
]


@pytest.mark.parametrize(("shape", "memory_format", "cut"), LAYOUTS)
def test_blocked_sums_equal_float64_sums_in_every_layout(shape, memory_format, cut):
    from distsync._syncbn import kernels as _sums
    from distsync._syncbn.payload import Scratch

    gen = torch.Generator().manual_seed(0)
    z, dy = (torch.randn(shape, generator=gen) + 0.3 for _ in range(2))
    if memory_format is not None:
        z, dy = (t.contiguous(memory_format=memory_format) for t in (z, dy))
    assert (_sums.blocks(tuple(z.shape), tuple(z.stride())) is not None) == cut
    mean, var = torch.randn(shape[1], generator=gen) * 0.1, torch.rand(shape[1], generator=gen) + 0.5
    dims = [0, *range(2, z.dim())]
    z64, dy64 = z.double(), dy.double()
    stats = [t.double().view(1, -1, *[1] * (z.dim() - 2)) for t in (mean, var)]
    x_hat = (z64 - stats[0]) / (stats[1] + 1e-5).sqrt()
    # the sums of a * b: sum(z), sum(z^2), sum(dy), sum(dy * x_hat)
    expected = [(z64, 1.0), (z64, z64), (dy64, 1.0), (dy64, x_hat)]
    # dy laid out like z (cut into blocks like z), and unlike it (summed as it is, one block per channel)
    unlike = (
        dy.contiguous() if memory_format is not None else dy.transpose(0, -1).contiguous().transpose(0, -1)
    )
    for dy_layout in (dy, unlike):
        found = (*_sums.moment_sums(z, Scratch()), *_sums.gradient_sums(dy_layout, z, mean, var, 1e-5))
        for value, (a, b) in zip(found, expected, strict=True):
            total, scale = (a * b).sum(dims), (a * b).abs().sum(dims)
            assert ((value.double() - total).abs() / scale).max() < 1e-6
