"""How the launcher starts its workers: a 2-job sweep of a Lightning + Hydra app with each start method.

    python benchmarks/start_methods.py [--repeats 2]

Runs ``tests/lightning_template`` (a LightningModule with torchmetrics metrics and batch norm, the
template's interpolated hydra node) as ``-m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2
model.lr=0.001,0.003`` with ``hydra.launcher.start_method`` = spawn, forkserver and fork, interleaved, and
prints the wall time of the whole command. ``spawn`` re-imports torch, Lightning, torchmetrics and the app in
every rank of every job; ``forkserver`` (the default) forks the ranks from a server that imported those
libraries once per launching process; ``fork`` copies the launching process (fastest, and unsafe once that
process has run torch ops: OpenMP's threads do not survive a fork, a forked worker hangs in its first
parallel op). A run that does not finish in ``--timeout`` seconds is reported as such.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "lightning_template"
METHODS = ("spawn", "forkserver", "fork")
SWEEP = ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "trainer=ddp_cpu_or_gpu"]
SWEEP += ["+plugin=distsync", "model.lr=0.001,0.003"]


def run_sweep(method: str, timeout: float) -> float | None:
    """Wall seconds of one 2-job sweep with ``method`` (None: it did not finish in ``timeout``)."""
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "project"
        shutil.copytree(TEMPLATE, project, ignore=shutil.ignore_patterns("logs", "__pycache__"))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests" / "_site"))
        command = [sys.executable, "train.py", *SWEEP, f"hydra.launcher.start_method={method}"]
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                command, cwd=project, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return None
        if proc.returncode != 0:
            raise RuntimeError(f"{method}: the sweep failed\n{proc.stderr[-3000:]}")
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    times: dict[str, list[float | None]] = {method: [] for method in METHODS}
    for _ in range(args.repeats):  # interleaved: the machine's load falls on every method alike
        for method in METHODS:
            times[method].append(run_sweep(method, args.timeout))
    spawn = statistics.median(t for t in times["spawn"] if t is not None)
    print("| start method | 2-job sweep, wall seconds (median) | runs | vs spawn |")
    print("|---|---|---|---|")
    for method in METHODS:
        done = [t for t in times[method] if t is not None]
        if not done:
            print(f"| {method} | did not finish in {args.timeout:g} s | {len(times[method])} | |")
            continue
        median = statistics.median(done)
        runs = ", ".join("timeout" if t is None else f"{t:.1f}" for t in times[method])
        print(f"| {method} | {median:.1f} | {runs} | {spawn / median:.2f}x faster |")


if __name__ == "__main__":
    main()
