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
    """The CPU: verdicts are read at the call, and its passes and per-channel arithmetic are those of
    :mod:`distsync._syncbn.host`."""

    deferred = False
    keeps_any_shift = True


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
