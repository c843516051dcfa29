"""The per-device passes over the activation: local statistics, normalization, and the two backward passes.

Both devices feed the same payload (local mean and biased variance per channel, ``_moments``) and read the
same merged statistics; they differ in the kernels that touch the activation:

* CUDA (ROCm included: PyTorch exposes it as the ``cuda`` device type) uses the ops ``nn.SyncBatchNorm``
  uses there, read against PyTorch's ``aten/src/ATen/native/cuda/Normalization.cu``/``.cuh``: the
  activation is read once for the statistics and once to normalize; backward reads ``dy`` and the input
  once to reduce and once for ``dx``. Three of those four ops exist for CUDA only.
* The CPU normalizes the input shifted by a value near its mean (a materialized copy), because its
  batch-norm kernels compute ``x * a + b`` and would round away a mean far from zero. Its reductions
  (``_sums``) are the float32 kernels of eval-mode BN backward, fed blocks short enough to keep
  ``nn.BatchNorm``'s accuracy.
* Every other device (MPS, XPU, ...) gets :class:`GenericKernels`: reductions and elementwise ops every
  backend implements, the same payload, no host sync.

Off the CPU the verdict of a call is read later (``deferred``, see :mod:`.health`): reading it at
once would stall the device's queue. Tests route the CPU through other kernels with :func:`routed`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from distsync._syncbn import sums as _sums
from distsync._syncbn.moments import stat_dtype

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
    def local(cls, input: Tensor) -> Local:
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
    def normalize(cls, local: Local, weight, bias, rows: Tensor, eps: float, clip: bool) -> Normalized:
        dtype = stat_dtype(local.z.dtype)
        stats = rows.to(dtype, copy=True)  # mean, biased var, unbiased var: worked on in place below
        # batch_norm_elemt reads mean and invstd as the accumulate type: float32 for float32 and half
        # inputs, float64 for float64 (packed_accessor_or_dummy<stat_accscalar_t>).
        kept = ((stats[1] >= eps).to(dtype),) if clip else ()  # channels whose variance is not clipped
        invstd = (stats[1].clamp_min_(eps) if clip else stats[1].add_(eps)).rsqrt_()
        output = cls.ops.batch_norm_elemt(
            local.z, cast_if_needed(weight, dtype), cast_if_needed(bias, dtype), stats[0], invstd, eps
        )
        return Normalized(output, (stats[0], invstd, *kept), (stats[0], stats[2]), eps)

    @classmethod
    def backward_sums(
        cls, dy: Tensor, z: Tensor, saved, weight, need_weight: bool, need_bias: bool, eps: float
    ):
        mean, invstd = saved[:2]
        # batch_norm_backward_reduce_cuda: mean and invstd of one dtype (TORCH_CHECK); the weight
        # gradient is allocated from the weight's options, so it is only asked for with a weight.
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = cls.ops.batch_norm_backward_reduce(
            dy,
            z,
            mean,
            invstd,
            cast_if_needed(weight, mean.dtype),
            True,
            need_weight and weight is not None,
            need_bias,
        )
        return sum_dy, sum_dy_xmu, grad_weight, grad_bias

    @classmethod
    def grad_input(
        cls, dy: Tensor, z: Tensor, saved, weight, reduced: Tensor, count: Tensor, eps: float
    ) -> Tensor:
        mean, invstd = saved[:2]
        sums = reduced.to(mean.dtype)  # sum_dy, sum_dy_xmu as the accumulate type, like mean and invstd
        if len(saved) > 2:  # clipped variance: no gradient through it in clipped channels
            sums[1].mul_(saved[2])
        # batch_norm_backward_elemt_cuda: `count` is read as int32 (count.data_ptr<int>()) and summed on
        # the device; the weight is read as the stat type once mean is float32 for half inputs.
        return cls.ops.batch_norm_backward_elemt(
            dy, z, mean, invstd, cast_if_needed(weight, mean.dtype), sums[0], sums[1], count.to(torch.int32)
        )

    @staticmethod
    def match_layout(dy: Tensor, z: Tensor) -> Tensor:
        if z.is_contiguous():
            return dy.contiguous()
        return dy.contiguous(memory_format=torch.channels_last_3d if z.dim() == 5 else torch.channels_last)


class CpuKernels:
    """Shifted input, ``batch_norm_update_stats``, eval-mode ``batch_norm`` and its backward."""

    deferred = False  # reduced values cost nothing to read on the CPU: verdicts at the call
    keeps_any_shift = True

    @staticmethod
    def local(input: Tensor) -> Local:
        if input.dtype in _HALF:
            # Mean and biased variance straight from the half input, without a float32 copy of it. The
            # kernel's parameter type is that of the running buffers (the input's without them: half
            # statistics, whose variance overflows at std 256): float32 scratch buffers, left as they were
            # by momentum 0, make it return float32 statistics, accumulated in float32 (Normalization.cpp's
            # mixed-type path, batch_norm_kernel.cpp's opmath accumulation).
            scratch = input.new_empty((2, input.shape[1]), dtype=torch.float32)
            mean, var = torch.batch_norm_update_stats(input, scratch[0], scratch[1], 0.0)
            return Local(input, mean, var, None)
        # Shifted near the mean, the sums keep the input's precision however far the mean is from zero.
        center = origin(input)
        z = input - per_channel(center, input.dim())
        count = z.numel() // z.shape[1]
        sums = _sums.moment_sums(z)  # sum(z), sum(z^2): one pass, float64 totals
        mean, mean_sq = (sums / count).unbind()
        var = torch.addcmul(mean_sq, mean, mean, value=-1)  # z is centred near 0: little cancels
        return Local(z, mean, var, center)

    @staticmethod
    def normalize(local: Local, weight, bias, rows: Tensor, eps: float, clip: bool) -> Normalized:
        dtype = stat_dtype(local.z.dtype)
        global_mean, biased, unbiased = rows.unbind()
        mean = global_mean if local.origin is None else global_mean - local.origin
        var = biased.clamp_min(eps) if clip else biased
        eps_used = 0.0 if clip else eps
        # The kernel computes z * scale + (bias - mean * scale). Its own scale, weight / sqrt(var + eps)
        # from a float32 var, is rounded five times (nn.BatchNorm's twice): here it is rounded once from
        # float64 and given as the weight, with variance 0 + eps 1 (invstd exactly 1).
        scale = (var if clip else var + eps).rsqrt()
        if weight is not None:
            scale = scale * weight
        scale, mean, var = torch.stack([scale, mean, var]).to(dtype).unbind()
        zeros = torch.zeros_like(mean)
        output = torch.batch_norm(
            local.z, scale, cast_if_needed(bias, dtype), mean, zeros, False, 0.0, 1.0, False
        )
        kept = ((biased >= eps).to(dtype),) if clip else ()
        return Normalized(output, (mean, var, *kept), (global_mean, unbiased), eps_used)

    @staticmethod
    def backward_sums(dy: Tensor, z: Tensor, saved, weight, need_weight: bool, need_bias: bool, eps: float):
        sum_dy, sum_dy_xhat = _sums.gradient_sums(dy, z, *saved[:2], eps)  # one pass over dy and z
        return sum_dy, sum_dy_xhat, sum_dy_xhat, sum_dy

    @staticmethod
    def grad_input(
        dy: Tensor, z: Tensor, saved, weight, reduced: Tensor, count: Tensor, eps: float
    ) -> Tensor:
        """dx = scale * (dy - mean(dy) - x_hat * mean(dy * x_hat)), means over all participants."""
        mean, var = saved[:2]
        scale = (var + eps).rsqrt()
        if weight is not None:
            scale = scale * cast_if_needed(weight, scale.dtype)
        coefficients = (reduced / -count).to(scale.dtype) * scale
        if len(saved) > 2:  # clipped variance: no gradient through it in clipped channels
            coefficients[1].mul_(saved[2])
        shift, slope = coefficients.unbind()
        # The x_hat-dependent part and the constant in one fused eval-mode batch-norm pass, then + scale*dy.
        grad_input = torch.batch_norm(z, slope, shift, mean, var, False, 0.0, eps, False)
        if dy.dtype == scale.dtype:
            return grad_input.addcmul_(dy, per_channel(scale, z.dim()))
        # Half inputs with float32 statistics: a mixed-dtype addcmul_ would make float32 copies of the whole
        # activation; mixed-precision eval-mode batch norm of dy computes scale * dy without any.
        zero = torch.zeros_like(mean)
        w = None if weight is None else weight.to(scale.dtype)
        return grad_input.add_(torch.batch_norm(dy, w, None, zero, var, False, 0.0, eps, False))

    @staticmethod
    def match_layout(dy: Tensor, z: Tensor) -> Tensor:
        return dy


def _dense(tensor: Tensor) -> bool:
    """Contiguous, or channels-last for a 4D/5D tensor: the layouts the CUDA kernels specialize for."""
    if tensor.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return tensor.dim() in formats and tensor.is_contiguous(memory_format=formats[tensor.dim()])


class GenericKernels:
    """Any other accelerator: ``var_mean``, sums and elementwise ops, which every backend implements.

    The same payload as the other devices and the same backward sums as the CPU (``sum(dy)``,
    ``sum(dy * x_hat)``). Like the CPU it works on the input shifted by a value near its mean (a copy in the
    statistics' dtype, float32 at least), so a mean far from zero keeps its accuracy; dedicated kernels
    would spare that copy.
    """

    deferred = True
    keeps_any_shift = True  # the statistics are those of the shifted input, as on the CPU

    @staticmethod
    def local(input: Tensor) -> Local:
        dims = [0, *range(2, input.dim())]
        if input.dtype in _HALF:  # no shift: the merge is around zero for half inputs (see functional)
            var, mean = torch.var_mean(input.float(), dims, correction=0)
            return Local(input, mean, var, None)
        center = origin(input)
        z = input - per_channel(center, input.dim())
        var, mean = torch.var_mean(z, dims, correction=0)
        return Local(z, mean, var, center)

    @staticmethod
    def normalize(local: Local, weight, bias, rows: Tensor, eps: float, clip: bool) -> Normalized:
        dtype = stat_dtype(local.z.dtype)
        var = rows[1].clamp_min(eps) if clip else rows[1] + eps
        kept = ((rows[1] >= eps).to(dtype),) if clip else ()
        mean = rows[0] if local.origin is None else rows[0] - local.origin
        saved = (mean.to(dtype), var.rsqrt().to(dtype), *kept)
        output = GenericKernels._x_hat(local.z, saved)
        if weight is not None:
            output.mul_(per_channel(weight.to(dtype), output.dim()))
        if bias is not None:
            output.add_(per_channel(bias.to(dtype), output.dim()))
        running = (rows[0].to(dtype), rows[2].to(dtype))
        return Normalized(output.to(local.z.dtype), saved, running, eps)

    @staticmethod
    def _x_hat(z: Tensor, saved) -> Tensor:
        mean, invstd = saved[:2]
        return (z.to(mean.dtype) - per_channel(mean, z.dim())).mul_(per_channel(invstd, z.dim()))

    @classmethod
    def backward_sums(
        cls, dy: Tensor, z: Tensor, saved, weight, need_weight: bool, need_bias: bool, eps: float
    ):
        dims = [0, *range(2, z.dim())]
        wide_dy = dy.to(saved[0].dtype)
        sum_dy = wide_dy.sum(dims)
        sum_dy_xhat = (wide_dy * cls._x_hat(z, saved)).sum(dims)
        return sum_dy, sum_dy_xhat, sum_dy_xhat, sum_dy

    @classmethod
    def grad_input(
        cls, dy: Tensor, z: Tensor, saved, weight, reduced: Tensor, count: Tensor, eps: float
    ) -> Tensor:
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
