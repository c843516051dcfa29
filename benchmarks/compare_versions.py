"""Is this checkout's layer slower than an earlier commit's? Both timed side by side in one gloo world.

    python benchmarks/compare_versions.py BASE_REV [--quick]

Extracts ``distsync/`` of ``BASE_REV`` (``git archive``) as the package ``distsync_base``, then times one
synchronized BN layer of each version (forward + backward, real all-reduces) in interleaved blocks on 2
ranks, and prints a Markdown table of medians and of the per-repetition ratio this/base. Run-to-run noise
on a shared machine is about +-10 % per shape; only a ratio that stays above 1 over several runs is a
regression.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import torch
from _harness import Budget, device, median, median_ratio, ratio_quartiles, run_world, time_interleaved
from _revisions import extract_base

CASES = [  # (input shape, dtype): the benchmark's headline layer rows and its fixed-cost shape
    ((8, 64, 8, 8), torch.float32),
    ((16, 64, 32, 32), torch.float32),
    ((16, 64, 32, 32), torch.bfloat16),
    ((2, 8, 2, 2), torch.float32),
]


def _fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def run() -> None:
        layer(x).backward(grad)
        x.grad = layer.weight.grad = layer.bias.grad = None

    return run


def compare(base_dir: str, quick: bool) -> list[dict]:
    """On every rank: time each case's layer from both versions; rank 0's rows are returned."""
    sys.path.insert(0, base_dir)
    versions = {name: importlib.import_module(name) for name in ("distsync_base", "distsync")}
    rows = []
    for shape, dtype in CASES:
        x = torch.randn(shape, device=device(), dtype=dtype, requires_grad=True)
        grad = torch.randn(shape, device=device(), dtype=dtype)
        variants = {
            name: _fwd_bwd(module.DistSyncBatchNorm2d(shape[1]).to(device()), x, grad)
            for name, module in versions.items()
        }
        inner = 50 if shape[0] * shape[2] <= 8 else 10
        times = time_interleaved(variants, Budget(reps=5 if quick else 15, inner=inner, warmup=10))
        rows.append(
            {
                "case": f"{tuple(shape)} {str(dtype).removeprefix('torch.')}",
                "base_ms": median(times["distsync_base"]) * 1e3,
                "this_ms": median(times["distsync"]) * 1e3,
                "ratio": median_ratio(times["distsync"], times["distsync_base"]),
                "quartiles": ratio_quartiles(times["distsync"], times["distsync_base"]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the git revision to compare against, e.g. HEAD~5 or a commit")
    parser.add_argument("--quick", action="store_true", help="5 repetitions instead of 15")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as base_dir:
        extract_base(args.base, Path(base_dir))
        rows = run_world(compare, base_dir, args.quick)
    print(f"| layer fwd+bwd, 2 ranks | {args.base} (ms) | this checkout (ms) | this / base (quartiles) |")
    print("|---|---|---|---|")
    for row in rows:
        q1, _, q3 = row["quartiles"]
        print(
            f"| {row['case']} | {row['base_ms']:.2f} | {row['this_ms']:.2f} | "
            f"{row['ratio']:.3f} ({q1:.2f}-{q3:.2f}) |"
        )


if __name__ == "__main__":
    main()
