"""Host time of one synchronized BN call (forward + backward), the collectives' own time left out.

    python benchmarks/host_cost.py [BASE_REV] [--quick]

On a GPU with small per-GPU batches the step time is the host's: Python, the dispatcher and kernel launches.
This measures that part on 2 gloo ranks, side by side in one run: the CPU time this rank's thread spends in
one forward + backward, minus the CPU time it spends inside ``torch.distributed.all_reduce`` (what the
transport costs is the transport's). Variants:

- ``floor``: ``nn.BatchNorm2d`` plus the two all-reduces of a sync payload that any synchronized BN needs;
- ``sketch``: the bare steps of a synchronized call (``_sketch.Sketch``, float32 cases), its two payloads
  all-reduced: no identity checks, verdicts, checkpointing or Join, so what a layer of this design in
  Python cannot go below;
- ``distsync``: this checkout's ``DistSyncBatchNorm2d``;
- ``base``: ``BASE_REV``'s, extracted as in ``compare_versions.py`` (when given).

Prints the median microseconds per call and the median per-repetition ratio to the floor.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _harness import Budget, run_world, time_interleaved
from _revisions import extract_base
from _sketch import Sketch
from torch import nn

CASES = [  # (input shape, dtype): the tiny fixed-cost shape, then the benchmark's headline layer shapes
    ((2, 8, 2, 2), torch.float32),
    ((8, 64, 8, 8), torch.float32),
    ((16, 64, 32, 32), torch.float32),
    ((8, 64, 8, 8), torch.bfloat16),
]


class _CollectiveClock:
    """Wraps ``dist.all_reduce`` (in this benchmark's processes only) to add up the thread CPU time spent
    inside it."""

    def __init__(self) -> None:
        self.inside = 0.0
        self._all_reduce = dist.all_reduce

    def __enter__(self) -> _CollectiveClock:
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return self._all_reduce(*args, **kwargs)
            finally:
                self.inside += time.thread_time() - start

        dist.all_reduce = timed
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._all_reduce

    def host_time(self) -> float:
        """This thread's CPU time so far, less what it spent inside the all-reduces."""
        return time.thread_time() - self.inside


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, payload: torch.Tensor | None = None):
    def run() -> None:
        out = layer(x)
        if payload is not None:
            dist.all_reduce(payload)
        out.backward(grad)
        if payload is not None:
            dist.all_reduce(payload)
        x.grad = layer.weight.grad = layer.bias.grad = None

    return run


def _sketch_fwd_bwd(native: nn.BatchNorm2d, x: torch.Tensor, grad: torch.Tensor):
    buffers = (native.running_mean, native.running_var, native.num_batches_tracked)

    def all_reduce(payload: torch.Tensor) -> None:
        dist.all_reduce(payload)  # looked up at each call: the clock's wrapper, as for the other variants

    def run() -> None:
        Sketch.apply(x, native.weight, native.bias, buffers, all_reduce).backward(grad)
        x.grad = native.weight.grad = native.bias.grad = None

    return run


def measure(base_dir: str | None, quick: bool) -> list[dict]:
    """On every rank: the host time of each case's variants; rank 0's rows are returned."""
    from distsync import DistSyncBatchNorm2d
    from distsync._syncbn.payload import payload_size

    torch.manual_seed(0)
    layers = {"distsync": DistSyncBatchNorm2d}
    if base_dir is not None:
        sys.path.insert(0, base_dir)
        layers["base"] = importlib.import_module("distsync_base").DistSyncBatchNorm2d
    rows = []
    with _CollectiveClock() as clock:
        for shape, dtype in CASES:
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            grad = torch.randn(shape, dtype=dtype)
            payload = torch.zeros(payload_size(shape[1]), dtype=torch.float64)
            variants = {"floor": _fwd_bwd(nn.BatchNorm2d(shape[1]), x, grad, payload)}
            if dtype == torch.float32:
                variants["sketch"] = _sketch_fwd_bwd(nn.BatchNorm2d(shape[1]), x, grad)
            variants.update({name: _fwd_bwd(cls(shape[1]), x, grad) for name, cls in layers.items()})
            small = shape[0] * shape[2] * shape[3] <= 512
            inner = (100 if small else 10) // (2 if quick else 1)
            budget = Budget(reps=5 if quick else 15, inner=inner, warmup=20)
            times = time_interleaved(variants, budget, clock.host_time)
            row = {"case": f"{shape} {str(dtype).removeprefix('torch.')}"}
            for name, values in times.items():
                row[name] = statistics.median(values)
                if name != "floor":
                    row[f"{name}/floor"] = statistics.median(
                        a / b for a, b in zip(values, times["floor"], strict=True)
                    )
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", nargs="?", help="a git revision to measure beside this checkout")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as base_dir:
        if args.base:
            extract_base(args.base, Path(base_dir))
        rows = run_world(measure, base_dir if args.base else None, args.quick)
    names = ["floor", "sketch", "distsync"] + (["base"] if args.base else [])
    ratios = [name for name in names if name != "floor"]
    header = [
        "layer fwd+bwd, 2 gloo ranks",
        *(f"{n} (us)" for n in names),
        *(f"{args.base if n == 'base' else n} / floor" for n in ratios),
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        times = [f"{row[n] * 1e6:.0f}" if n in row else "-" for n in names]
        cells = [row["case"], *times, *(f"{row[f'{n}/floor']:.2f}" if n in row else "-" for n in ratios)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
