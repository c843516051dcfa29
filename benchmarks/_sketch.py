"""The bare steps of a synchronized BN call in Python: a measure of the floor, not a layer.

``Sketch`` is an autograd Function doing only what any synchronized BN of distsync's design does: the local
sums (one native reduction kernel), a float64 payload built and read on the host, the merge, one
normalization kernel and the running statistics forward; the same again backward. No identity checks, no
verdicts, no checkpointing, Join or subclass handling, no accuracy care (plain sums, no shift). Its
payloads go through ``all_reduce`` when one is given (``host_cost.py``'s 2-rank world), else nowhere
(``host_floor_sketch.py``). float32 inputs of any shape.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from distsync._syncbn.payload import TAIL, payload_size  # the payload's size class and tail length

_reduce = torch.ops.aten.native_batch_norm_backward  # eval-mode BN backward: per-channel sums in one kernel


def _payload(first: torch.Tensor, second: torch.Tensor) -> np.ndarray:
    c = first.numel()
    payload = np.zeros(payload_size(c))
    payload[:c], payload[c : 2 * c] = first.numpy(), second.numpy()
    return payload


class Sketch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, buffers, all_reduce: Callable[[torch.Tensor], object] | None):
        running_mean, running_var, batches = buffers
        c = x.shape[1]
        zeros = torch.zeros(c)
        _, squares, sums = _reduce(x, x, None, zeros, zeros, None, None, False, 1.0, [False, True, True])
        payload = _payload(sums, squares)
        payload[-TAIL] = x.numel() // c
        if all_reduce is not None:
            all_reduce(torch.from_numpy(payload))
        count = payload[-TAIL:].tolist()[0]  # the reduced tail is read here
        mean = payload[:c] / count
        var = np.maximum(payload[c : 2 * c] / count - mean * mean, 0)
        invstd = 1 / np.sqrt(var + 1e-5)
        scale = invstd * weight.detach().to(torch.float64, copy=True).numpy()
        rows = np.stack([scale, mean]).astype(np.float32)
        scale_t, mean_t = torch.from_numpy(rows[0]), torch.from_numpy(rows[1])
        out = torch.batch_norm(x, scale_t, bias, mean_t, zeros, False, 0.0, 1.0, False)
        ends = np.stack([mean, var * count / (count - 1)]).astype(np.float32)
        torch._foreach_lerp_([running_mean, running_var], [torch.from_numpy(e) for e in ends], 0.1)
        batches.add_(1)
        ctx.save_for_backward(x)
        ctx.stats = (scale_t, mean_t, scale, invstd, count, zeros, all_reduce)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        scale_t, mean_t, scale, invstd, count, zeros, all_reduce = ctx.stats
        c = x.shape[1]
        _, grad_x_sums, grad_sums = _reduce(
            grad, x, None, mean_t, zeros, None, None, False, 1.0, [False, True, True]
        )
        payload = _payload(grad_sums, grad_x_sums)
        if all_reduce is not None:
            all_reduce(torch.from_numpy(payload))
        payload[-TAIL:].tolist()  # the reduced tail is read here
        factor = -scale / count
        grad_x, grad_sum = payload[c : 2 * c], payload[:c]
        terms = np.stack([factor * invstd * invstd * grad_x, factor * grad_sum]).astype(np.float32)
        grad_input = torch.batch_norm(
            x, torch.from_numpy(terms[0]), torch.from_numpy(terms[1]), mean_t, zeros, False, 0.0, 1.0, False
        )
        grad_input.addcmul_(grad, scale_t.view(1, -1, *[1] * (x.dim() - 2)))
        grad_weight = torch.from_numpy((invstd * payload[c : 2 * c]).astype(np.float32))
        return grad_input, grad_weight, torch.from_numpy(payload[:c].astype(np.float32)), None, None
