"""How low the host cost of a synchronized BN call can go in Python: a bare sketch against the layer.

    python benchmarks/host_floor_sketch.py

One process, no communication, CPU, shape (2, 8, 2, 2). Three variants, best of 15 rounds of 300 calls:

- ``native``: ``nn.BatchNorm2d`` forward + backward;
- ``sketch``: only the steps any synchronized BN of distsync's design takes (``_sketch.Sketch``: an autograd
  Function, local sums, a payload built and read on the host, the merge, one normalization kernel, the
  running statistics, the same again backward), with no identity checks, verdicts, checkpointing, Join or
  subclass handling: not a layer, only a measure of the floor;
- ``layer``: ``DistSyncBatchNorm2d`` with its collectives replaced by nothing (``_layer_bench``).

Prints microseconds per call and the ratio to native. docs/performance.md quotes it.
"""

from __future__ import annotations

import time

import torch
from _layer_bench import _no_comm_layer
from _sketch import Sketch
from torch import nn

CHANNELS = 8
SHAPE = (2, CHANNELS, 2, 2)


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
        "sketch": call(native, lambda: Sketch.apply(x, native.weight, native.bias, buffers, None)),
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
