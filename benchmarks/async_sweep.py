"""Sweeps of trials of unequal length on the packed launcher: Hydra's Optuna sweeper (batches) against
distsync_optuna (a trial per free slot), without and with pruning, side by side in one run.

    python benchmarks/async_sweep.py [--trials 8] [--baseline-venv benchmarks/results/venv-hydra-optuna]
    python benchmarks/async_sweep.py --base main --no-hydra   # trial starts: main's distsync vs this one

Each trial is a 1-core world of ``tests/optuna_app.py`` (``hydra/launcher=torchrun``, ``n_jobs=2`` on the
2-core machine) that works ``steps`` steps of ``step_seconds`` (``steps=choice(2,16)``: some trials run 8x
longer than others), reports ``x + 1/(step+1)`` at each step and returns ``x``. Hydra's Optuna sweeper
(1.3.0, which needs optuna<3) runs in a venv of its own, made on the first run; distsync_optuna runs here
(current Optuna), with the nop pruner and with the median pruner. Prints, per sweeper: wall time to
``--trials`` finished trials, the best value reached and when, how many trials were pruned, and how long a
trial's core stays free: from a trial's last line to the first line of the next trial on its core (median
and max; with batches, the wait for the batch's other trial is in it). ``--base REV`` adds distsync_optuna
of git revision ``REV`` (this checkout's app), for a before/after in one run; ``--no-hydra`` leaves out
Hydra's sweeper (no venv to build).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _job_starts import checkout_of, describe, env_running, slot_gaps
from _revisions import ROOT

APP = ROOT / "tests" / "optuna_app.py"
BASELINE = ROOT / "benchmarks" / "results" / "venv-hydra-optuna"


def make_baseline_venv(venv: Path) -> Path:
    """A venv with Hydra's Optuna sweeper (optuna 2.10) and this checkout; its python."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    packages = ["torch==2.13.0", "-e", str(ROOT), "hydra-optuna-sweeper", "sqlalchemy<2"]
    subprocess.run([*pip, *packages], check=True)
    return python


def run(python: Path, sweeper: list[str], trials: int, label: str, checkout: Path = ROOT) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp) / "sweep"
        command = [
            str(python), str(APP), "-m", *sweeper, f"hydra.sweeper.n_trials={trials}",
            "hydra.sweeper.n_jobs=2", "hydra/launcher=torchrun", "hydra.launcher.n_jobs=2",
            "hydra.sweeper.sampler.seed=1",
            "x=interval(0,10)", "steps=choice(2,16)", "step_seconds=0.3", f"hydra.sweep.dir={sweep}",
        ]  # fmt: skip
        env = env_running(checkout, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests" / "_site")
        start = time.time()
        proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=1200)
        wall = time.time() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{label}: the sweep failed\n{proc.stderr[-3000:]}")
        records = [json.loads(p.read_text()) for p in sweep.glob("*/rank0.json")]
        finished = [r for r in records if r["pruned_at"] is None]
        best = min(finished, key=lambda r: r["x"])
        results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
        return {
            "sweeper": label,
            "wall": wall,
            "best": results["best_value"],
            "best_after": best["end"] - start,
            "pruned": len(records) - len(finished),
            "trials": len(records),
            "gaps": slot_gaps([{**r, "slot": tuple(r["cores"])} for r in records]),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline-venv", type=Path, default=BASELINE)
    parser.add_argument("--no-hydra", action="store_true", help="leave out Hydra's Optuna sweeper")
    parser.add_argument("--base", help="a git revision whose distsync_optuna runs too, for comparison")
    args = parser.parse_args()
    ours = Path(sys.executable)
    modes = []
    if not args.no_hydra:
        baseline = make_baseline_venv(args.baseline_venv)
        label = "Hydra's Optuna sweeper 1.3.0 (batches of 2), optuna 2.10"
        modes.append((baseline, ["hydra/sweeper=optuna"], label, ROOT))
    median = ["hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=2"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            base = checkout_of(args.base, Path(tmp))
            modes.append((ours, ["hydra/sweeper=distsync_optuna"], f"distsync_optuna of {args.base}", base))
        modes += [
            (ours, ["hydra/sweeper=distsync_optuna"], "distsync_optuna (a trial per free slot)", ROOT),
            (ours, ["hydra/sweeper=distsync_optuna", *median], "distsync_optuna + median pruner", ROOT),
        ]
        rows = []
        for _ in range(args.repeats):  # interleaved: the machine's load falls on every sweeper alike
            rows += [run(python, sweeper, args.trials, label, co) for python, sweeper, label, co in modes]
    title = f"sweeper ({args.trials} trials, 2 at a time)"
    gap = "trial end -> next trial's first line, s: median (max)"
    print(f"| {title} | wall s | trials/min | best value | best after s | pruned | {gap} |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        rate = row["trials"] / row["wall"] * 60
        print(
            f"| {row['sweeper']} | {row['wall']:.1f} | {rate:.1f} | {row['best']:.3f} | "
            f"{row['best_after']:.1f} | {row['pruned']} | {describe(row['gaps'])} |"
        )


if __name__ == "__main__":
    main()
