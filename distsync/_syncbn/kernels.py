"""The per-device passes over the activation: local statistics, normalization, and the two backward passes.

One table row per device, each with the same five entries (``local``, ``normalize``, ``backward_sums``,
``grad_input``, ``match_layout``) that :mod:`distsync.functional`'s one forward and one backward call. Every
row feeds the same payload (local mean and biased variance per channel, ``_payload``) and reads the same
merged statistics (float64 rows from ``_payload.merge``); they differ in the kernels that touch the
activation:

* CUDA (ROCm included: PyTorch exposes it as the ``cuda`` device type) uses the ops ``nn.SyncBatchNorm``
  uses there, read against PyTorch's ``aten/src/ATen/native/cuda/Normalization.cu``/``.cuh``: the
  activation is read once for the statistics and once to normalize; backward reads ``dy`` and the input
  once to reduce and once for ``dx``. Three of those four ops exist for CUDA only.
* The CPU normalizes the input shifted by a value near its mean (a materialized copy), because its
  batch-norm kernels compute ``x * a + b`` and would round away a mean far from zero. Its reductions
  are the float32 kernels of eval-mode BN backward, fed blocks short enough to keep ``nn.BatchNorm``'s
  accuracy (the blocked sums at the end of this module).
* Every other device (MPS, XPU, ...) gets :class:`GenericKernels`: reductions and elementwise ops every
  backend implements, the same payload, no host sync.

Off the CPU the verdict of a call is read later (``deferred``, see :mod:`.health`): reading it at
once would stall the device's queue. On the CPU it is read at the call, which also lets a float64 merge
that lost digits be redone around its own mean (``functional``). Tests route the CPU through other
kernels with :func:`routed`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from distsync._syncbn.payload import Scratch, stat_dtype

_HALF = (torch.float16, torch.bfloat16)


def per_channel(values: Tensor, ndim: int) -> Tensor:
    """View a (C,) tensor so that it broadcasts over an (N, C, *) input of ``ndim`` dimensions."""
    return values.view(1, -1, *([1] * (ndim - 2)))


SPREAD = 4  # positions per non-channel dimension averaged into the shift's origin


def origin(input: Tensor) -> Tensor:
    """A per-channel value near the batch's mean, to subtract before summing: the mean of ``SPREAD``
    evenly spread positions along every non-channel dimension (64 values of a 4D input: one strided view,
    whatever the layout), 0 where it is not finite, so that an inf stays an inf as in ``nn.BatchNorm``.

    The nearer the origin is to the mean, the fewer digits the shifted sums and the normalization of
    the shifted input lose: one sample's values are a standard deviation or more away, the mean of 64
    about a tenth of one, which keeps float32 outputs as accurate as ``nn.BatchNorm``'s."""
    sizes, strides = [input.shape[1]], [input.stride(1)]
    for dim in (0, *range(2, input.dim())):
        size = input.shape[dim]
        sizes.append(min(size, SPREAD))
        strides.append(input.stride(dim) * max(size // SPREAD, 1))
    spread = input.as_strided(sizes, strides, input.storage_offset())
    return spread.mean(tuple(range(1, len(sizes)))).nan_to_num_(0.0, 0.0, 0.0)


class Local(NamedTuple):
    """This rank's input as it is normalized (``z``), its per-channel mean and biased variance, and the
    per-channel ``origin`` subtracted from the input to get ``z`` (None for none)."""

    z: Tensor
    mean: Tensor
    var: Tensor
    origin: Tensor | None


class Normalized(NamedTuple):
    output: Tensor
    saved: tuple[Tensor, ...]  # what backward needs besides z and weight
    running: tuple[Tensor, Tensor]  # mean and unbiased variance for the running statistics
    eps: float  # the eps backward uses


def cast_if_needed(tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``tensor`` in ``dtype``, itself when it already is (or is None): no copy on the common path."""
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


class CudaKernels:
    """``batch_norm_update_stats`` / ``batch_norm_elemt`` / ``batch_norm_backward_reduce`` / ``_elemt``.

    The ops are looked up on ``ops`` (``torch``): a test substitutes CPU implementations of them.
    """

    ops = torch
    deferred = True  # verdicts read later: a host read per call would stall the device
    keeps_any_shift = False  # the float32 statistics batch_norm_elemt takes gain nothing from a float64 shift

    @classmethod
    def local(cls, input: Tensor, scratch: Scratch) -> Local:
        # Normalization.cu: the kernels take contiguous, channels-last or (as TensorIterator) general
        # strides, but backward_elemt picks its template from dy's layout alone; keep to the two layouts
        # nn.SyncBatchNorm keeps to, so that input and dy can always be given the same one.
        if not _dense(input):
            input = input.contiguous()
        # batch_norm_update_stats_cuda with no running buffers is batch_norm_mean_var: one Welford pass,
        # mean and biased variance in the accumulate type (float32 for half inputs).
        mean, var = cls.ops.batch_norm_update_stats(input, None, None, 0.0)
        return Local(input, mean, var, None)

    @classmethod
    def normalize(
        cls, local: Local, weight, bias, rows: Tensor, eps: float, clip: bool, scratch: Scratch
    ) -> Normalized:
        dtype = stat_dtype(local.z.dtype)
        # batch_norm_elemt reads mean and invstd as the accumulate type: float32 for float32 and half
        # inputs, float64 for float64 (packed_accessor_or_dummy<stat_accscalar_t>). One conversion of the
        # merged rows [[mean, invstd], [var, unbiased var]] (none for float64).
        stats = rows.to(dtype)
        mean, invstd = stats[0]
        # clipped variance: no gradient through it in channels where it was clipped (var <= eps)
        kept = (stats[1, 0] > eps,) if clip else ()
        output = cls.ops.batch_norm_elemt(
            local.z, cast_if_needed(weight, dtype), cast_if_needed(bias, dtype), mean, invstd, eps
        )
        return Normalized(output, (mean, invstd, *kept), (mean, stats[1, 1]), eps)

    @classmethod
    def backward_sums(
        cls, dy: Tensor, z: Tensor, saved, weight, need_input: bool, need_weight: bool, need_bias: bool
    ):
        mean, invstd = saved[:2]
        # batch_norm_backward_reduce_cuda: mean and invstd of one dtype (TORCH_CHECK); the weight
        # gradient is allocated from the weight's options, so it is only asked for with a weight.
        return cls.ops.batch_norm_backward_reduce(
            dy,
            z,
            mean,
            invstd,
            cast_if_needed(weight, mean.dtype),
            need_input,
            need_weight and weight is not None,
            need_bias,
        )

    @classmethod
    def grad_input(cls, dy: Tensor, z: Tensor, saved, weight, reduced: Tensor, count: Tensor, ones) -> Tensor:
        mean, invstd = saved[:2]
        # batch_norm_backward_elemt_cuda multiplies the sums by 1 / sum(count) (count read as int32 per
        # rank, summed on the device): given the means themselves, divided here in float64 and rounded
        # once to the accumulate type, with a count of 1 (``ones``).
        means = torch.empty(reduced.shape, dtype=mean.dtype, device=mean.device)
        torch.div(reduced, count, out=means)
        if len(saved) > 2:  # clipped variance: no gradient through it in clipped channels
            means[1].mul_(saved[2])
        # the weight is read as the stat type once mean is float32 for half inputs
        return cls.ops.batch_norm_backward_elemt(
            dy, z, mean, invstd, cast_if_needed(weight, mean.dtype), means[0], means[1], ones
        )

    @staticmethod
    def match_layout(dy: Tensor, z: Tensor) -> Tensor:
        if z.is_contiguous():
            return dy.contiguous()
        return dy.contiguous(memory_format=torch.channels_last_3d if z.dim() == 5 else torch.channels_last)


class CpuKernels:
    """The CPU: ``nn.BatchNorm``'s own kernels (``aten/src/ATen/native/cpu/batch_norm_kernel.cpp``).

    Its eval-mode kernels compute ``x * a + b`` per channel, which would round away a mean far from zero, so
    the input is shifted by a value near its mean first (``origin``: a copy). The statistics and backward's
    two sums are eval-mode batch-norm backward's reductions over blocks short enough to keep
    ``nn.BatchNorm``'s accuracy (:func:`moment_sums`, :func:`gradient_sums`). The per-channel scale and
    shift are computed in float64 and rounded once, on numpy views of the merged rows: on the CPU they are
    host memory, and a few numpy operations cost a fraction of the dispatches the same arithmetic takes in
    torch ops. Verdicts are read at the call, for the same reason.
    """

    deferred = False
    keeps_any_shift = False  # float32 is merged around zero: float64's digits cover what its shift loses

    @staticmethod
    def local(input: Tensor, scratch: Scratch) -> Local:
        if input.dtype in _HALF:
            # Mean and biased variance straight from the half input, without a float32 copy of it: float32
            # scratch buffers left as they were by momentum 0 make the kernel return float32 statistics
            # accumulated in float32 (Normalization.cpp's mixed-type path); the input's own dtype would give
            # half statistics, whose variance overflows at std 256.
            stats = input.new_empty((2, input.shape[1]), dtype=torch.float32)
            mean, var = torch.batch_norm_update_stats(input, stats[0], stats[1], 0.0)
            return Local(input, mean, var, None)
        center = origin(input)
        z = input - per_channel(center, input.dim())
        sums, squares = (_host(t) for t in moment_sums(z, scratch))
        count = z.numel() // z.shape[1]
        mean = sums / count
        return Local(z, torch.from_numpy(mean), torch.from_numpy(squares / count - mean * mean), center)

    @staticmethod
    def normalize(
        local: Local, weight, bias, rows: Tensor, eps: float, clip: bool, scratch: Scratch
    ) -> Normalized:
        """``z * scale + (bias - mean * scale)`` as one eval-mode batch-norm pass (weight ``scale``, mean
        ``mean``, variance 0 and eps 1: invstd exactly 1), the scale rounded once from float64."""
        dtype = stat_dtype(local.z.dtype)
        merged = rows.numpy()
        invstd = merged[0, 1]
        # a copy: a numpy view would pin the parameter's storage (FSDP frees and regrows it between steps)
        scale = invstd if weight is None else invstd * weight.detach().to(torch.float64, copy=True).numpy()
        # [scale, mean in z's coordinates, running mean, running (unbiased) variance], rounded once
        coefficients = np.empty((4, invstd.size), dtype=_NUMPY[dtype])
        coefficients[0] = scale
        coefficients[1] = merged[0, 0] if local.origin is None else merged[0, 0] - _host(local.origin)
        coefficients[2] = merged[0, 0]
        coefficients[3] = merged[1, 1]
        # what backward multiplies the reduced sum(dy * (z - mean)), sum(dy) and local sum(dy * (z - mean))
        # by: -scale invstd^2 (none in channels whose variance was clipped), -scale, and invstd
        factors = np.empty((3, invstd.size))
        np.multiply(scale, -invstd * invstd, out=factors[0])
        if clip:
            factors[0] *= merged[1, 0] > eps
        np.negative(scale, out=factors[1])
        factors[2] = invstd
        scale_t, mean_t, *running = (torch.from_numpy(row) for row in coefficients)
        zeros = zeros_of(invstd.size, dtype, rows.device, scratch)
        output = torch.batch_norm(
            local.z, scale_t, cast_if_needed(bias, dtype), mean_t, zeros, False, 0.0, 1.0, False
        )
        return Normalized(output, (scale_t, mean_t, zeros, torch.from_numpy(factors)), tuple(running), eps)

    @staticmethod
    def backward_sums(
        dy: Tensor, z: Tensor, saved, weight, need_input: bool, need_weight: bool, need_bias: bool
    ):
        _, mean, zeros, factors = saved
        sum_dy, sum_dy_xmu = (_host(t) for t in gradient_sums(dy, z, mean, zeros, 1.0))
        first, second = torch.from_numpy(sum_dy), torch.from_numpy(sum_dy_xmu)
        if weight is None or weight.dtype not in _NUMPY:
            return first, second, torch.from_numpy(factors.numpy()[2] * sum_dy_xmu), first
        # the parameters' gradients rounded once, in their dtype
        grads = np.empty((2, sum_dy.size), dtype=_NUMPY[weight.dtype])
        np.multiply(factors.numpy()[2], sum_dy_xmu, out=grads[0], casting="same_kind")
        grads[1] = sum_dy
        return first, second, torch.from_numpy(grads[0]), torch.from_numpy(grads[1])

    @staticmethod
    def grad_input(dy: Tensor, z: Tensor, saved, weight, reduced: Tensor, count: Tensor, ones) -> Tensor:
        """``dx = scale * (dy - mean(dy) - x_hat * mean(dy * x_hat))``, the means over all participants, from
        the reduced ``sum(dy)`` and ``sum(dy * (z - mean))``: the x_hat-dependent part and the constant in
        one eval-mode batch-norm pass of z, plus ``scale * dy``."""
        scale, mean, zeros, factors = saved
        terms = np.empty((2, mean.numel()), dtype=_NUMPY[mean.dtype])
        np.multiply(factors.numpy()[:2], reduced.numpy()[::-1] / count.item(), out=terms, casting="same_kind")
        slope, shift = torch.from_numpy(terms[0]), torch.from_numpy(terms[1])
        result = torch.batch_norm(z, slope, shift, mean, zeros, False, 0.0, 1.0, False)
        if dy.dtype == mean.dtype:
            return result.addcmul_(dy, per_channel(scale, z.dim()))
        # Half inputs with float32 statistics: a mixed-dtype addcmul_ would make float32 copies of the whole
        # activation; mixed-precision eval-mode batch norm of dy computes scale * dy without any.
        return result.add_(torch.batch_norm(dy, scale, None, zeros, zeros, False, 0.0, 1.0, False))

    @staticmethod
    def match_layout(dy: Tensor, z: Tensor) -> Tensor:
        return dy


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


def _host(tensor: Tensor) -> np.ndarray:
    """The float64 values of a small CPU tensor this module made (per-channel sums, a center)."""
    return tensor.numpy().astype(np.float64)


def _dense(tensor: Tensor) -> bool:
    """Contiguous, or channels-last for a 4D/5D tensor: the layouts the CUDA kernels specialize for."""
    if tensor.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return tensor.dim() in formats and tensor.is_contiguous(memory_format=formats[tensor.dim()])


class GenericKernels:
    """Any other accelerator: ``var_mean``, sums and elementwise ops, which every backend implements.

    The same payload as the other devices and the same backward sums as the CPU (``sum(dy)``,
    ``sum(dy * x_hat)``). It works on the input shifted by a value near its mean (a copy in the
    statistics' dtype, float32 at least), so a mean far from zero keeps its accuracy; dedicated kernels
    would spare that copy.
    """

    deferred = True
    keeps_any_shift = True  # the statistics are those of the shifted input, as on the CPU

    @staticmethod
    def local(input: Tensor, scratch: Scratch) -> Local:
        dims = [0, *range(2, input.dim())]
        if input.dtype in _HALF:  # no shift: the merge is around zero for half inputs (see functional)
            var, mean = torch.var_mean(input.float(), dims, correction=0)
            return Local(input, mean, var, None)
        center = origin(input)
        z = input - per_channel(center, input.dim())
        var, mean = torch.var_mean(z, dims, correction=0)
        return Local(z, mean, var, center)

    @staticmethod
    def normalize(
        local: Local, weight, bias, rows: Tensor, eps: float, clip: bool, scratch: Scratch
    ) -> Normalized:
        dtype = stat_dtype(local.z.dtype)
        mean = rows[0, 0] if local.origin is None else rows[0, 0] - local.origin
        kept = ((rows[1, 0] > eps).to(dtype),) if clip else ()
        saved = (mean.to(dtype), rows[0, 1].to(dtype), *kept)
        output = GenericKernels._x_hat(local.z, saved)
        if weight is not None:
            output.mul_(per_channel(weight.to(dtype), output.dim()))
        if bias is not None:
            output.add_(per_channel(bias.to(dtype), output.dim()))
        running = (rows[0, 0].to(dtype), rows[1, 1].to(dtype))
        return Normalized(output.to(local.z.dtype), saved, running, eps)

    @staticmethod
    def _x_hat(z: Tensor, saved) -> Tensor:
        mean, invstd = saved[:2]
        return (z.to(mean.dtype) - per_channel(mean, z.dim())).mul_(per_channel(invstd, z.dim()))

    @classmethod
    def backward_sums(
        cls, dy: Tensor, z: Tensor, saved, weight, need_input: bool, need_weight: bool, need_bias: bool
    ):
        dims = [0, *range(2, z.dim())]
        wide_dy = dy.to(saved[0].dtype)
        sum_dy = wide_dy.sum(dims)
        sum_dy_xhat = (wide_dy * cls._x_hat(z, saved)).sum(dims)
        return sum_dy, sum_dy_xhat, sum_dy_xhat, sum_dy

    @classmethod
    def grad_input(cls, dy: Tensor, z: Tensor, saved, weight, reduced: Tensor, count: Tensor, ones) -> Tensor:
        """dx = scale * (dy - mean(dy) - x_hat * mean(dy * x_hat)), means over all participants."""
        mean, invstd = saved[:2]
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        means = (reduced / count).to(mean.dtype)
        if len(saved) > 2:  # clipped variance: no gradient through it in clipped channels
            means[1].mul_(saved[2])
        nd = z.dim()
        inner = dy.to(mean.dtype) - per_channel(means[0], nd)
        inner.sub_(cls._x_hat(z, saved).mul_(per_channel(means[1], nd)))
        return inner.mul_(per_channel(scale, nd)).to(dy.dtype)

    @staticmethod
    def match_layout(dy: Tensor, z: Tensor) -> Tensor:
        return dy


# ------------------------------------------------------------------------- the CPU's blocked sums
#
# Per-channel sums over an activation on the CPU, as accurate as ``nn.BatchNorm``'s, in one pass.
#
# The CPU path gets its local moments, ``sum(z)`` and ``sum(z^2)``, and backward's ``sum(dy)`` and
# ``sum(dy * x_hat)`` from one eval-mode ``native_batch_norm_backward`` pass (the reductions eval-mode BN
# backward computes). Read against PyTorch's ``aten/src/ATen/native/cpu/batch_norm_kernel.cpp``, its float32
# kernels accumulate in float32 where the activation is long: a whole ``(n, c)`` plane in one vector of
# accumulators (contiguous layout), or every row of the batch (channels-last layout), and round each
# channel's total to float32. The local variance ``E[z^2] - E[z]^2`` then inherits that error, amplified by
# the shift's distance from the mean: 2e-5 at 4M values per channel in 1024x1024 planes, where
# ``nn.BatchNorm``'s forward accumulates in float64.
#
# So the same kernel is given a view of the same memory in which each "channel" is a block of one channel's
# values: runs of at most ``RUN`` contiguous values of a plane, or at most ``ROWS`` rows of a channels-last
# batch. Each block's float32 accumulation stays short, and the blocks' float32 totals are summed per channel
# in float64, so that their roundings average out. The same pass, the same kernel, no copy of the activation;
# the partials are 1/256 of it (1/36 at most). Short planes and batches, other layouts, a ``dy`` laid out
# unlike the input, and other dtypes (float64 accumulates in float64; half inputs' float32 accumulation is
# far finer than their own rounding) are reduced as they are, one block per channel.

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


def moment_sums(z: Tensor, scratch: Scratch) -> tuple[Tensor, Tensor]:
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


def zeros_of(channels: int, dtype: torch.dtype, device: torch.device, scratch: Scratch) -> Tensor:
    """Per-channel zeros kept in ``scratch`` (a layer's): read-only arguments of the kernels."""
    return scratch.kept(
        ("zeros", channels, dtype, device), lambda: torch.zeros(channels, dtype=dtype, device=device)
    )


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


Kernels = type[CudaKernels] | type[CpuKernels] | type[GenericKernels]
_routes: dict[str, Kernels] = {}


def kernels_for(device: torch.device) -> Kernels:
    """The kernels for ``device``'s type: CPU, CUDA (ROCm is ``cuda`` too), or generic for the rest."""
    if device.type in _routes:
        return _routes[device.type]
    if device.type == "cpu":
        return CpuKernels
    return CudaKernels if device.type == "cuda" else GenericKernels


@contextlib.contextmanager
def routed(device_type: str, kernels: Kernels) -> Iterator[None]:
    """Run ``device_type``'s tensors through ``kernels`` inside the block (tests: CUDA's path on the CPU)."""
    previous = _routes.get(device_type)
    _routes[device_type] = kernels
    try:
        yield
    finally:
        if previous is None:
            _routes.pop(device_type, None)
        else:
            _routes[device_type] = previous
