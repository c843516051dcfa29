"""CPU implementations of the four CUDA batch-norm ops the CUDA path calls, written to the CUDA kernels.

Read against PyTorch's ``aten/src/ATen/native/cuda/Normalization.cu``: statistics in the accumulate type
(float32 for half, bfloat16 and float32 inputs, float64 for float64), the dtype checks that raise there,
and what each op allocates (outputs in the input's layout, sums in the statistics' dtype, the weight
gradient from the weight's options). :class:`EmulatedCudaKernels` is distsync's CUDA kernel class with
these ops; a test routes CPU tensors through it with ``kernels.routed("cpu", ...)``, which runs
the whole CUDA code path (its kernels, tails and deferred verdicts) in a gloo world.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from distsync._syncbn import health as _health
from distsync._syncbn import kernels as _kernels

_HALF = (torch.float16, torch.bfloat16)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """at::acc_type<scalar_t, /*is_cuda=*/true>: float for half types and float, double for double."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _bc(values: Tensor, ndim: int) -> Tensor:
    return values.view(1, -1, *[1] * (ndim - 2))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_floating(x: Tensor) -> None:
    # AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16, ...)
    _require(
        x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64),
        f"\"batch_norm\" not implemented for '{x.dtype}'",
    )


def _param_dtype(x: Tensor, *params: Tensor | None) -> torch.dtype:
    """is_mixed_type: a half input takes float parameters only if all of them are float; else the input's."""
    given = [p for p in params if p is not None]
    mixed = x.dtype in _HALF and any(p.dtype == torch.float32 for p in given)
    if mixed:
        _require(
            all(p.dtype == torch.float32 for p in given),
            "Expected parameter to have the same dtype as input or all parameters float",
        )
        return torch.float32
    for p in given:
        _require(p.dtype == x.dtype, f"expected scalar type {x.dtype} but found {p.dtype}")
    return x.dtype


def _stat(t: Tensor, acc: torch.dtype, name: str) -> None:
    # packed_accessor_or_dummy<stat_accscalar_t>: the data pointer's type is checked.
    _require(t.dtype == acc, f"expected scalar type {acc} but found {t.dtype} ({name})")


class EmulatedCudaOps:
    @staticmethod
    def batch_norm_update_stats(x, running_mean, running_var, momentum):
        # batch_norm_update_stats_cuda -> batch_norm_mean_var: Welford in the accumulate type; outputs of
        # that type, (C,); biased variance. Running buffers are not used by distsync (None).
        _check_floating(x)
        _require(running_mean is None and running_var is None, "emulation: running buffers unused")
        acc = _acc(x.dtype)
        var, mean = torch.var_mean(x.to(acc), _dims(x), correction=0)
        return mean, var

    @staticmethod
    def batch_norm_elemt(x, weight, bias, mean, invstd, eps):
        # output = empty_like(self, self.suggest_memory_format()); mean and invstd read as stat accscalar.
        _check_floating(x)
        acc = _acc(x.dtype)
        _stat(mean, acc, "mean")
        _stat(invstd, acc, "invstd")
        wdtype = _param_dtype(x, weight, bias)
        nd = x.dim()
        y = (x.to(acc) - _bc(mean, nd)) * _bc(invstd, nd)
        if weight is not None:
            y = y * _bc(weight.to(wdtype).to(acc), nd)
        if bias is not None:
            y = y + _bc(bias.to(wdtype).to(acc), nd)
        out = torch.empty_like(x)  # dense input: its own strides, as suggest_memory_format() gives
        return out.copy_(y)

    @staticmethod
    def batch_norm_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
        _check_floating(dy)
        _require(mean.dtype == invstd.dtype, "mean and invstd need to have the same data types")
        _param_dtype(x, weight)
        acc = _acc(x.dtype)
        _stat(mean, acc, "mean")
        nd = x.dim()
        dy_acc = dy.to(acc)
        sum_dy = dy_acc.sum(_dims(x))
        sum_dy_xmu = (dy_acc * (x.to(acc) - _bc(mean, nd))).sum(_dims(x))
        grad_weight = grad_bias = None
        if weight_g:  # at::empty({n_input}, weight.options()): needs a weight
            _require(weight is not None, "batch_norm_backward_reduce: weight_g without a weight")
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if bias_g:
            grad_bias = sum_dy.to(mean.dtype if weight is None else weight.dtype)
        if not input_g:
            sum_dy = sum_dy_xmu = None
        return (
            None if sum_dy is None else sum_dy.to(mean.dtype),
            None if sum_dy_xmu is None else sum_dy_xmu.to(mean.dtype),
            grad_weight,
            grad_bias,
        )

    @staticmethod
    def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        _check_floating(dy)
        _require(mean.dtype == invstd.dtype, "mean and invstd need to have the same data types")
        _require(count.dtype == torch.int32, f"expected scalar type Int but found {count.dtype} (count)")
        acc = _acc(x.dtype)
        for name, t in (("mean", mean), ("sum_dy", sum_dy), ("sum_dy_xmu", sum_dy_xmu)):
            _stat(t, acc, name)
        half_float = x.dtype in _HALF and mean.dtype == torch.float32
        if weight is not None:
            _require(
                weight.dtype == (torch.float32 if half_float else x.dtype),
                f"expected scalar type of weight {mean.dtype}, found {weight.dtype}",
            )
        n = count.sum().to(acc)  # the kernel sums the per-rank counts on the device
        nd = x.dim()
        factor = _bc(invstd * invstd * sum_dy_xmu / n, nd)
        g = dy.to(acc) - _bc(sum_dy / n, nd) - (x.to(acc) - _bc(mean, nd)) * factor
        scale = invstd if weight is None else invstd * weight.to(acc)
        g = g * _bc(scale, nd)
        out = torch.empty_like(dy)
        return out.copy_(g)


class EmulatedCudaKernels(_kernels.CudaKernels):
    """distsync's CUDA kernel class, through :class:`EmulatedCudaOps`."""

    ops = EmulatedCudaOps


@contextlib.contextmanager
def cuda_path_on_cpu():
    """CPU tensors take the CUDA code path inside the block; the deferred checks start empty."""
    _health._monitor.__init__()
    with _kernels.routed("cpu", EmulatedCudaKernels):
        try:
            yield
        finally:
            _health._monitor.__init__()
