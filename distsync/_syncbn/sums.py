"""Per-channel sums over an activation on the CPU, as accurate as ``nn.BatchNorm``'s, in one pass.

The CPU path gets its local moments, ``sum(z)`` and ``sum(z^2)``, and backward's ``sum(dy)`` and
``sum(dy * x_hat)`` from one eval-mode ``native_batch_norm_backward`` pass (the reductions eval-mode BN
backward computes). Read against PyTorch's ``aten/src/ATen/native/cpu/batch_norm_kernel.cpp``, its float32
kernels accumulate in float32 where the activation is long: a whole ``(n, c)`` plane in one vector of
accumulators (contiguous layout), or every row of the batch (channels-last layout), and round each
channel's total to float32. The local variance ``E[z^2] - E[z]^2`` then inherits that error, amplified by
the shift's distance from the mean: 2e-5 at 4M values per channel in 1024x1024 planes, where
``nn.BatchNorm``'s forward accumulates in float64.

So the same kernel is given a view of the same memory in which each "channel" is a block of one channel's
values: runs of at most ``RUN`` contiguous values of a plane, or at most ``ROWS`` rows of a channels-last
batch. Each block's float32 accumulation stays short, and the blocks' float32 totals are summed per channel
in float64, so that their roundings average out. The same pass, the same kernel, no copy of the activation;
the partials are 1/256 of it (1/36 at most). Short planes and batches, other layouts, a ``dy`` laid out
unlike the input, and other dtypes (float64 accumulates in float64; half inputs' float32 accumulation is
far finer than their own rounding) are reduced as they are, one block per channel.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

RUN = 256  # longest run of a plane summed in float32 (the kernel adds up runs of several samples in float64)
ROWS = 1024  # most rows of a channels-last batch summed in float32 (more blocks would spill the L1 cache)
SPAN = 64  # fewest values per block worth a partial (the partials stay <= 1/SPAN of the activation)
_PRIMES = (2, 3, 5, 7)
_backward = torch.ops.aten.native_batch_norm_backward


class Blocks(NamedTuple):
    """A view of an activation of ``C`` channels as ``outer * C * inner`` blocks, each reduced alone."""

    size: tuple[int, ...]  # the view fed to the kernel: (rows, blocks, run) or (1, blocks, rows, 1)
    stride: tuple[int, ...]
    split: tuple[int, int, int]  # blocks = outer x C x inner, in memory order

    def view(self, tensor: Tensor) -> Tensor:
        return tensor.as_strided(self.size, self.stride, tensor.storage_offset())

    def per_block(self, values: Tensor) -> Tensor:
        """``(k, C)`` per-channel values repeated for each block: ``(k, blocks)``."""
        outer, channels, inner = self.split
        k = values.shape[0]
        return values.view(k, 1, channels, 1).expand(k, outer, channels, inner).reshape(k, -1)

    def per_channel(self, partials: Tensor) -> Tensor:
        """``(k, blocks)`` float32 partial sums to ``(k, C)`` float64 totals."""
        outer, channels, inner = self.split
        return partials.view(-1, outer, channels, inner).sum((1, 3), dtype=torch.float64)


def _split(total: int, limit: int) -> tuple[int, int]:
    """``total = kept * moved`` with ``kept <= limit`` where small prime factors allow it (else as close)."""
    kept, moved = total, 1
    while kept > limit:
        prime = next((p for p in _PRIMES if kept % p == 0), None)
        if prime is None:
            break
        kept, moved = kept // prime, moved * prime
    return kept, moved


def _row_major(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether ``sizes``/``strides`` lay the elements out densely in this order (size-1 dims ignored)."""
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=256)
def blocks(sizes: tuple[int, ...], strides: tuple[int, ...]) -> Blocks | None:
    """How to cut an activation of ``sizes`` (N, C, *) and ``strides`` into blocks: contiguous planes longer
    than ``RUN`` into runs of at most ``RUN`` values (grouped over samples into blocks of at least ``SPAN``
    values), channels-last (and 2D) batches of more than ``ROWS`` rows into blocks of at most ``ROWS`` rows;
    None where the kernel's own float32 accumulation is already that short, or for any other layout."""
    samples, channels = sizes[0], sizes[1]
    plane = math.prod(sizes[2:])
    if plane > 1 and _row_major(sizes, strides):
        run, inner = _split(plane, RUN)
        if inner == 1:
            return None
        rows, outer = 1, samples  # sample n = row * outer + o: the kernel adds a block's rows in float64
        while rows * run < SPAN and outer > 1:
            prime = next((p for p in _PRIMES if outer % p == 0), outer)
            rows, outer = rows * prime, outer // prime
        count = outer * channels * inner
        return Blocks((rows, count, run), (count * run, run, 1), (outer, channels, inner))
    if _row_major((samples, *sizes[2:], channels), (strides[0], *strides[2:], strides[1])):
        height, outer = _split(samples * plane, ROWS)  # channels-last, or 2D: rows of C values
        if outer == 1:
            return None
        count = outer * channels
        # A channels-last 4D view, so that the kernel adds each block's rows in its vectorized row loop.
        return Blocks((1, count, height, 1), (count * height, 1, count, count), (outer, channels, 1))
    return None


def _cut(z: Tensor) -> Blocks | None:
    return blocks(tuple(z.shape), tuple(z.stride())) if z.dtype == torch.float32 else None


def moment_sums(z: Tensor, scratch: dict) -> tuple[Tensor, Tensor]:
    """``sum(z)`` and ``sum(z^2)`` per channel of ``z`` (float32 or float64), in one pass: float64 when summed
    in blocks, else in ``z``'s dtype (the kernel's float64 accumulation rounded once)."""
    cut = _cut(z)
    view = z if cut is None else cut.view(z)
    zeros = zeros_of(view.shape[1], z.dtype, z.device, scratch)
    # Eval-mode BN backward of dy = z at the input z, around mean 0 with invstd 1 / sqrt(0 + 1): the bias
    # gradient is sum(dy) = sum(z), the weight gradient sum(dy * z) = sum(z^2).
    _, squares, sums = _backward(view, view, None, zeros, zeros, None, None, False, 1.0, [False, True, True])
    if cut is None:
        return sums, squares
    return cut.per_channel(torch.stack([sums, squares])).unbind()


def zeros_of(channels: int, dtype: torch.dtype, device: torch.device, scratch: dict) -> Tensor:
    """Per-channel zeros kept in ``scratch`` (a layer's): read-only arguments of the kernels."""
    key = ("zeros", channels, dtype, device)
    zeros = scratch.get(key)
    if zeros is None:
        zeros = scratch[key] = torch.zeros(channels, dtype=dtype, device=device)
    return zeros


def gradient_sums(dy: Tensor, z: Tensor, mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``sum(dy)`` and ``sum(dy * x_hat)`` per channel, ``x_hat = (z - mean) / sqrt(var + eps)``, in one pass
    over ``dy`` and ``z``: float64 when summed in blocks, else in the statistics' dtype (``mean``'s)."""
    cut = _cut(z) if dy.stride() == z.stride() else None  # blocks need both in one layout
    if cut is not None:
        mean, var = cut.per_block(torch.stack([mean, var])).unbind()
        dy, z = cut.view(dy), cut.view(z)
    _, sum_dy_xhat, sum_dy = _backward(dy, z, None, mean, var, None, None, False, eps, [False, True, True])
    if cut is None:
        return sum_dy, sum_dy_xhat
    return cut.per_channel(torch.stack([sum_dy, sum_dy_xhat])).unbind()
