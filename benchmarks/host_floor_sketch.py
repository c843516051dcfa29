"""How low the host cost of a synchronized BN call can go in Python: a bare sketch against the layer.

    python benchmarks/host_floor_sketch.py

One process, no communication, CPU, shape (2, 8, 2, 2). Three variants, best of 15 rounds of 300 calls:

- ``native``: ``nn.BatchNorm2d`` forward + backward;
- ``sketch``: only the steps any synchronized BN of distsync's design takes: an autograd Function, the local
  sums (one native reduction kernel), a float64 payload built and read on the host, the merge, one
  normalization kernel, the running statistics, and the same again backward. No identity checks, no
  verdicts, no checkpointing, Join or subclass handling: it is not a layer, only a measure of the floor;
- ``layer``: ``DistSyncBatchNorm2d`` with its collectives replaced by nothing (``_layer_bench``).

Prints microseconds per call and the ratio to native. docs/performance.md quotes it.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from _layer_bench import _no_comm_layer
from torch import nn

CHANNELS = 8
SHAPE = (2, CHANNELS, 2, 2)
TAIL = 15  # the payload's tail of identity and count fields
_reduce = torch.ops.aten.native_batch_norm_backward  # eval-mode BN backward: per-channel sums in one kernel


class _Sketch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, buffers):
        running_mean, running_var, batches = buffers
        zeros = torch.zeros(CHANNELS)
        _, squares, sums = _reduce(x, x, None, zeros, zeros, None, None, False, 1.0, [False, True, True])
        payload = np.zeros(256)
        payload[:CHANNELS], payload[CHANNELS : 2 * CHANNELS] = sums.numpy(), squares.numpy()
        payload[-TAIL] = x.numel() // CHANNELS
        count = payload[-TAIL:].tolist()[0]  # the reduced tail would be read here
        mean = payload[:CHANNELS] / count
        var = np.maximum(payload[CHANNELS : 2 * CHANNELS] / count - mean * mean, 0)
        invstd = 1 / np.sqrt(var + 1e-5)
        scale = invstd * weight.detach().to(torch.float64, copy=True).numpy()
        rows = np.stack([scale, mean]).astype(np.float32)
        scale_t, mean_t = torch.from_numpy(rows[0]), torch.from_numpy(rows[1])
        out = torch.batch_norm(x, scale_t, bias, mean_t, zeros, False, 0.0, 1.0, False)
        ends = np.stack([mean, var * count / (count - 1)]).astype(np.float32)
        torch._foreach_lerp_([running_mean, running_var], [torch.from_numpy(e) for e in ends], 0.1)
        batches.add_(1)
        ctx.save_for_backward(x)
        ctx.stats = (scale_t, mean_t, scale, invstd, count, zeros)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        scale_t, mean_t, scale, invstd, count, zeros = ctx.stats
        reduced = _reduce(grad, x, None, mean_t, zeros, None, None, False, 1.0, [False, True, True])
        _, grad_x_sums, grad_sums = reduced
        payload = np.zeros(256)
        payload[:CHANNELS], payload[CHANNELS : 2 * CHANNELS] = grad_sums.numpy(), grad_x_sums.numpy()
        payload[-TAIL:].tolist()  # the reduced tail would be read here
        factor = -scale / count
        grad_x, grad_sum = payload[CHANNELS : 2 * CHANNELS], payload[:CHANNELS]
        terms = np.stack([factor * invstd * invstd * grad_x, factor * grad_sum]).astype(np.float32)
        grad_input = torch.batch_norm(
            x, torch.from_numpy(terms[0]), torch.from_numpy(terms[1]), mean_t, zeros, False, 0.0, 1.0, False
        )
        grad_input.addcmul_(grad, scale_t.view(1, -1, 1, 1))
        grad_weight = torch.from_numpy((invstd * payload[CHANNELS : 2 * CHANNELS]).astype(np.float32))
        return grad_input, grad_weight, torch.from_numpy(payload[:CHANNELS].astype(np.float32)), None


def main() -> None:
    torch.set_num_threads(1)
    x, grad = torch.randn(SHAPE, requires_grad=True), torch.randn(SHAPE)
    native, layer = nn.BatchNorm2d(CHANNELS), _no_comm_layer(CHANNELS, torch.device("cpu"))
    buffers = (native.running_mean, native.running_var, native.num_batches_tracked)

    def call(module, forward):
        def run() -> None:
            forward().backward(grad)
            x.grad = module.weight.grad = module.bias.grad = None

        return run

    variants = {
        "native": call(native, lambda: native(x)),
        "sketch": call(native, lambda: _Sketch.apply(x, native.weight, native.bias, buffers)),
        "layer": call(layer, lambda: layer(x)),
    }
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(15):
        for name, run in variants.items():
            for _ in range(20):
                run()
            start = time.thread_time()
            for _ in range(300):
                run()
            best[name] = min(best[name], (time.thread_time() - start) / 300 * 1e6)
    print(f"| {SHAPE}, one process, no communication | us per fwd+bwd | / native |")
    print("|---|---|---|")
    for name, micros in best.items():
        print(f"| {name} | {micros:.0f} | {micros / best['native']:.2f} |")


if __name__ == "__main__":
    main()
