"""The CPU's synchronized call: the passes over the activation in torch, per-channel arithmetic on the host.

On the CPU the reduced payload is host memory and reading it costs nothing, so everything between the passes
over the activation (building the payload, the merge, the checks, the normalization and gradient
coefficients) is done on numpy views of the same memory: a few microseconds of host time per call, where the
same work as torch ops is a few dozen dispatches. The tensors the caller can see (the output, the gradients,
the running statistics, ``num_batches_tracked``) are still made and updated by torch ops, so autograd's
version counters and tensor subclasses see what they would see with ``nn.BatchNorm``.

The numerics: the input shifted by a per-channel center near the batch's mean (so that a mean far from zero
costs the sums and the normalization nothing), sums accurate to float32's rounding or better
(``_syncbn.sums``), and a float64 merge. The payload's layout and the tail are those of
:mod:`distsync._syncbn.moments` and :mod:`distsync._syncbn.identity`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from distsync._syncbn import moments as _moments
from distsync._syncbn import sums as _sums
from distsync._syncbn.identity import COUNT, FAILED, GUARD, TAIL, CallTag, payload_size
from distsync._syncbn.kernels import origin, per_channel

__all__ = [
    "Coefficients",
    "HostLocal",
    "Merged",
    "coefficients",
    "grad_input",
    "gradient_sums",
    "local",
    "merge",
    "check",
    "normalize",
    "pack",
    "np_dtype",
    "pack_sums",
    "to_tensor",
]

_HALF = (torch.float16, torch.bfloat16)
_NUMPY_FLOATS = (torch.float32, torch.float64)


class HostLocal(NamedTuple):
    """This rank's input as it is normalized (``z``: the input less ``center``, or the input itself), the
    per-channel ``center`` (float64, None for none), and the sums of ``z`` and of its squares (float64)."""

    z: Tensor
    center: np.ndarray | None
    sums: np.ndarray
    squares: np.ndarray


def as_numpy(tensor: Tensor) -> np.ndarray:
    """A float64 (or float32) host array of the values of a CPU tensor this module made (a view where the
    dtype allows: never of a user's tensor, whose storage a view would pin)."""
    tensor = tensor.detach()
    if tensor.dtype not in _NUMPY_FLOATS:
        tensor = tensor.float()
    return tensor.numpy()


def local(input: Tensor, count: int, scratch: dict) -> HostLocal:
    """The pass that reads the input for its statistics: ``count`` values per channel, around a per-channel
    center near this batch's mean (``kernels.origin``: a function of the batch alone, so the output depends
    on nothing else, bit for bit, and a recomputation repeats it exactly)."""
    if input.dtype in _HALF:
        # Mean and biased variance straight from the half input, without a float32 copy of it. The kernel's
        # parameter type is that of the running buffers (the input's without them: half statistics, whose
        # variance overflows at std 256): float32 scratch buffers, left as they were by momentum 0, make it
        # return float32 statistics accumulated in float32 (Normalization.cpp's mixed-type path).
        stats = input.new_empty((2, input.shape[1]), dtype=torch.float32)
        mean, var = torch.batch_norm_update_stats(input, stats[0], stats[1], 0.0)
        m, v = mean.numpy().astype(np.float64), var.numpy().astype(np.float64)
        return HostLocal(input, None, m * count, (v + m * m) * count)
    # Shifted near the mean, the sums and the normalization keep the input's precision however far the mean
    # is from zero.
    center = origin(input)
    z = input - per_channel(center, input.dim())
    sums, squares = _sums.moment_sums(z, scratch)
    return HostLocal(z, center.numpy().astype(np.float64), as_numpy(sums).astype(np.float64),
                     as_numpy(squares).astype(np.float64))  # fmt: skip


def pack(
    part: HostLocal | None, shift: np.ndarray | None, count: int, tail: np.ndarray, channels: int,
    failed: bool,
) -> np.ndarray:  # fmt: skip
    """This rank's forward payload (``_moments``' layout) as sums around ``shift`` (None for zero): the
    first and second moment sums of its values less the shift, zeros up to the size class,
    then ``tail`` with the count in its slot. Zeros for no input, and a failed tail for a rejected one."""
    c = channels
    payload = np.zeros(payload_size(c))
    end = payload[payload.size - TAIL :]
    end[:] = tail
    if failed:
        end[COUNT], end[FAILED] = 0.0, 1.0
        end[GUARD] -= 1.0
        return payload
    end[COUNT] = count
    if part is None:
        return payload
    # sum(z - b) and sum((z - b)^2), b the offset between the shift and the input's center
    if part.center is None:
        b = shift
    else:
        b = -part.center if shift is None else shift - part.center
    if b is None:
        payload[:c] = part.sums
        payload[c : 2 * c] = part.squares
    else:
        payload[:c] = part.sums - count * b
        payload[c : 2 * c] = part.squares - 2 * b * (part.sums - 0.5 * count * b)
    return payload


class Merged(NamedTuple):
    """The global statistics of one call: mean (relative to the shift), biased and unbiased variance."""

    mean: np.ndarray
    var: np.ndarray
    unbiased: np.ndarray
    count: float


def merge(payload: np.ndarray, channels: int) -> Merged:
    """Global mean, biased and unbiased variance from a reduced payload with a global count of at least 2
    (exact to float64 rounding: see ``_moments.merge``)."""
    count = float(payload[payload.size - TAIL + COUNT])
    first, second = payload[:channels], payload[channels : 2 * channels]
    mean = first / count
    deviations = np.maximum(second - first * mean, 0.0)  # sums of squared deviations
    return Merged(mean, deviations / count, deviations / (count - 1), count)


def costs_accuracy(merged: Merged, eps: float) -> bool:
    """``_moments.costs_accuracy`` on the host."""
    return bool(np.any(merged.var - merged.mean * merged.mean / _moments.REFINE < -eps))


class Coefficients(NamedTuple):
    """What normalizing a call takes, and what its backward reuses."""

    scale_t: Tensor  # weight / std in the statistics' dtype
    mean: Tensor  # the global mean in z's coordinates, in the statistics' dtype
    scale: np.ndarray  # weight / std, float64
    invstd: np.ndarray  # 1 / std (its square scales the gradient's second term), float64
    kept: np.ndarray | None  # clipped variance: 1 where the variance is not clipped, else 0
    count: float
    zeros: Tensor  # per-channel zeros in the statistics' dtype (the kernels' variance and mean arguments)


def coefficients(
    merged: Merged, center: np.ndarray | None, weight: Tensor | None, eps: float, clip: bool,
    dtype: torch.dtype, scratch: dict,
) -> Coefficients:  # fmt: skip
    """The per-channel scale and mean the normalization applies to z (``merged.mean`` is absolute)."""
    var = merged.var
    if clip:
        invstd = 1.0 / np.sqrt(np.maximum(var, eps))
        kept = (var >= eps).astype(np.float64)
    else:
        invstd = 1.0 / np.sqrt(var + eps)
        kept = None
    # a copy: a numpy view would pin the parameter's storage (FSDP frees and regrows it between steps)
    scale = invstd if weight is None else invstd * weight.detach().to(torch.float64, copy=True).numpy()
    rows = np.empty((2, var.size), dtype=np_dtype(dtype))
    rows[0] = scale
    rows[1] = merged.mean if center is None else merged.mean - center
    scale_t, mean_t = torch.from_numpy(rows[0]), torch.from_numpy(rows[1])
    zeros = _sums.zeros_of(var.size, dtype, torch.device("cpu"), scratch)
    return Coefficients(scale_t, mean_t, scale, invstd, kept, merged.count, zeros)


def normalize(z: Tensor, bias: Tensor | None, coef: Coefficients) -> Tensor:
    """``(z - mean) * scale + bias``: one eval-mode batch-norm pass whose kernel computes ``z * a + b``, its
    scale rounded once from float64 (given as the weight, with variance 0 and eps 1: invstd exactly 1)."""
    mean = coef.mean
    zeros = coef.zeros
    if bias is not None and bias.dtype != mean.dtype:
        bias = bias.to(mean.dtype)
    return torch.batch_norm(z, coef.scale_t, bias, mean, zeros, False, 0.0, 1.0, False)


def gradient_sums(dy: Tensor, z: Tensor, coef: Coefficients) -> tuple[np.ndarray, np.ndarray]:
    """``sum(dy)`` and ``sum(dy * (z - mean))`` per channel, in one pass (float64 host arrays)."""
    sum_dy, sum_dy_xmu = _sums.gradient_sums(dy, z, coef.mean, coef.zeros, 1.0)
    return as_numpy(sum_dy).astype(np.float64), as_numpy(sum_dy_xmu).astype(np.float64)


def grad_input(dy: Tensor, z: Tensor, coef: Coefficients, reduced: np.ndarray) -> Tensor:
    """``dx = scale * (dy - mean(dy) - x_hat * mean(dy * x_hat))``, the means over all participants, from the
    reduced ``sum(dy)`` and ``sum(dy * (z - mean))`` (rows of ``reduced``): the x_hat-dependent part and the
    constant in one eval-mode batch-norm pass of z, plus ``scale * dy``."""
    factor = -coef.scale / coef.count
    dtype = coef.mean.dtype
    terms = np.empty((2, factor.size), dtype=np_dtype(dtype))
    terms[0] = factor * coef.invstd * coef.invstd * reduced[1]
    if coef.kept is not None:  # clipped variance: no gradient through it in clipped channels
        terms[0] *= coef.kept
    terms[1] = factor * reduced[0]
    zeros = coef.zeros
    slope, shift = torch.from_numpy(terms[0]), torch.from_numpy(terms[1])
    result = torch.batch_norm(z, slope, shift, coef.mean, zeros, False, 0.0, 1.0, False)
    if dy.dtype == dtype:
        return result.addcmul_(dy, per_channel(coef.scale_t, z.dim()))
    # Half inputs with float32 statistics: a mixed-dtype addcmul_ would make float32 copies of the whole
    # activation; mixed-precision eval-mode batch norm of dy computes scale * dy without any.
    return result.add_(torch.batch_norm(dy, coef.scale_t, None, zeros, zeros, False, 0.0, 1.0, False))


def to_tensor(values: np.ndarray, dtype: torch.dtype) -> Tensor:
    """A CPU tensor of ``dtype`` holding float64 host ``values`` (rounded once)."""
    if dtype in _NUMPY_FLOATS:
        return torch.from_numpy(values.astype(np_dtype(dtype)))
    return torch.from_numpy(values).to(dtype)


def pack_sums(first: np.ndarray, second: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """A backward payload: two per-channel sums, zeros, then ``tail``."""
    c = first.size
    payload = np.zeros(payload_size(c))
    payload[:c] = first
    payload[c : 2 * c] = second
    payload[payload.size - TAIL :] = tail
    return payload


def check(payload: np.ndarray, tag: CallTag, world_size: int, problem: str | None, training: bool) -> float:
    """Raise what the reduced ``payload`` of call ``tag`` calls for (on every participant alike); return the
    global count."""
    verdict = _moments.verdict(payload[payload.size - TAIL :].tolist(), world_size)
    _moments.raise_for(verdict, tag, world_size, problem, training)
    return verdict.count


def np_dtype(dtype: torch.dtype):
    return np.float64 if dtype == torch.float64 else np.float32
