"""Sweeps of trials of unequal length on the packed launcher: Hydra's Optuna sweeper (batches) against
distsync_optuna (a trial per free slot), without and with pruning, side by side in one run.

    python benchmarks/async_sweep.py [--trials 8] [--baseline-venv benchmarks/results/venv-hydra-optuna]

Each trial is a 1-core world of ``tests/optuna_app.py`` (``hydra/launcher=torchrun``, ``n_jobs=2`` on the
2-core machine) that works ``steps`` steps of ``step_seconds`` (``steps=choice(2,16)``: some trials run 8x
longer than others), reports ``x + 1/(step+1)`` at each step and returns ``x``. Hydra's Optuna sweeper
(1.3.0, which needs optuna<3) runs in a venv of its own, made on the first run; distsync_optuna runs here
(current Optuna), with the nop pruner and with the median pruner. Prints, per sweeper: wall time to
``--trials`` finished trials, the best value reached and when, and how many trials were pruned.
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

ROOT = Path(__file__).resolve().parents[1]
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


def run(python: Path, sweeper: list[str], trials: int, label: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp) / "sweep"
        command = [
            str(python), str(APP), "-m", *sweeper, f"hydra.sweeper.n_trials={trials}",
            "hydra.sweeper.n_jobs=2", "hydra/launcher=torchrun", "hydra.launcher.n_jobs=2",
            "hydra.sweeper.sampler.seed=1",
            "x=interval(0,10)", "steps=choice(2,16)", "step_seconds=0.3", f"hydra.sweep.dir={sweep}",
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests" / "_site"))
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
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline-venv", type=Path, default=BASELINE)
    args = parser.parse_args()
    baseline = make_baseline_venv(args.baseline_venv)
    ours = Path(sys.executable)
    modes = [
        (baseline, ["hydra/sweeper=optuna"], "Hydra's Optuna sweeper 1.3.0 (batches of 2), optuna 2.10"),
        (ours, ["hydra/sweeper=distsync_optuna"], "distsync_optuna (a trial per free slot)"),
        (
            ours,
            [
                "hydra/sweeper=distsync_optuna",
                "hydra/sweeper/pruner=median",
                "hydra.sweeper.pruner.n_startup_trials=2",
            ],
            "distsync_optuna + median pruner",
        ),
    ]
    rows = []
    for _ in range(args.repeats):  # interleaved: the machine's load falls on every sweeper alike
        rows += [run(python, sweeper, args.trials, label) for python, sweeper, label in modes]
    title = f"sweeper ({args.trials} trials, 2 at a time)"
    print(f"| {title} | wall s | trials/min | best value | best after s | pruned |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        rate = row["trials"] / row["wall"] * 60
        print(
            f"| {row['sweeper']} | {row['wall']:.1f} | {rate:.1f} | {row['best']:.3f} | "
            f"{row['best_after']:.1f} | {row['pruned']} |"
        )


if __name__ == "__main__":
    main()
