"""Benchmark distsync's synchronized batch norm against native BN, the floor and nn.SyncBatchNorm.

    python benchmarks/bench_syncbn.py [--quick] [--out benchmarks/results] [--profile]

Spawns its own gloo world (2 ranks x 1 thread), prints Markdown tables, writes results.json and syncbn.png.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _harness import Budget, device, run_world
from _layer_bench import allreduce_latency, bench_layers, profile_layer
from _model_bench import CHANNELS, bench_model, bench_resnet18
from _report import table, write

HEADLINE = [(8, 64, 8, 8), (16, 64, 32, 32)]


@dataclass(frozen=True)
class Plan:
    """What one run measures and for how long."""

    quick: bool
    profile: bool
    world_size: int = 2

    @property
    def budgets(self) -> tuple[Budget, Budget, Budget]:
        """(headline layer shapes, sweep points, model steps)."""
        if self.quick:
            return Budget(reps=9, inner=10), Budget(reps=5, inner=5), Budget(reps=7, inner=3)
        return Budget(reps=31, inner=20), Budget(reps=11, inner=10), Budget(reps=25, inner=5)

    @property
    def sweeps(self) -> dict[str, list[tuple[int, int, int, int]]]:
        channels = (16, 64, 256) if self.quick else (16, 32, 64, 128, 256, 512)
        batches = (2, 8, 32) if self.quick else (2, 4, 8, 16, 32)
        return {"channels": [(8, c, 16, 16) for c in channels], "batch": [(n, 64, 16, 16) for n in batches]}


def suite(plan: Plan) -> dict:
    """Everything a rank measures; every rank runs it in the same order."""
    layer_budget, sweep_budget, model_budget = plan.budgets
    layers = bench_layers(HEADLINE, plan.sweeps, layer_budget, sweep_budget)
    results = {
        "meta": {
            **asdict(plan),
            "reps": layer_budget.reps,
            "device": device().type,
            "torch": torch.__version__,
        },
        "layers": layers,
        "model": bench_model(model_budget, with_torch_syncbn=layers["torch_syncbn"] is None),
        "allreduce_latency": allreduce_latency(CHANNELS),
        "resnet18": bench_resnet18(model_budget),
    }
    if plan.profile:
        results["profiles"] = {str(shape): profile_layer(shape) for shape in HEADLINE}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sweep points (~30 s)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="JSON+PNG folder")
    parser.add_argument("--profile", action="store_true", help="also print profiler tables of the sync layer")
    args = parser.parse_args()
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    results = run_world(suite, Plan(quick=args.quick, profile=args.profile))
    results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    results["meta"]["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(table(results))
    for shape, text in results.get("profiles", {}).items():
        print(f"\nProfile of 200 distsync fwd+bwd calls, rank 0, shape {shape}:\n{text}")
    paths = write(results, args.out)
    print(f"\nwrote {', '.join(map(str, paths))} in {results['meta']['wall_s']} s")


if __name__ == "__main__":
    main()
