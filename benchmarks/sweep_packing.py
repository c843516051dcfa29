"""A sweep packed onto the machine vs one job at a time: ``hydra.launcher.n_jobs``, measured.

    python benchmarks/sweep_packing.py            # ~1.5 min on 2 cores; --steps 600 for a quick look

Runs a copy of ``examples/hydra_app`` (outside the checkout, as a user's app) as a sweep of 4 one-rank jobs
through ``hydra/launcher=torchrun``, each job training the app's MLP single-threaded (``OMP_NUM_THREADS=1``)
for about 10 s of CPU: once with ``hydra.launcher.n_jobs=1`` and once with ``n_jobs=2`` (two jobs at a time,
each on its own cores), in one invocation, then prints the wall times side by side. Both sweeps must
return every job's value; the script checks that each job wrote its record and ended training.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VALUES = "0.05,0.1,0.2,0.4"


def run_sweep(app: Path, n_jobs: int, steps: int) -> float:
    """Wall seconds of the 4-job sweep with ``n_jobs`` at a time; raises if a job did not finish."""
    sweep = app / f"multirun-{n_jobs}"
    args = [
        sys.executable,
        "app.py",
        "-m",
        "hydra/launcher=torchrun",
        "hydra.launcher.nproc_per_node=1",
        f"hydra.launcher.n_jobs={n_jobs}",
        f"lr={VALUES}",
        f"steps={steps}",
        "model.hidden=256",
        "batch_size=256",
        f"hydra.sweep.dir={sweep}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "DISTSYNC_TEST_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=app, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"the n_jobs={n_jobs} sweep failed:\n{proc.stderr[-3000:]}")
    for job in range(len(VALUES.split(","))):
        record = json.loads((sweep / str(job) / "rank0.json").read_text())
        assert record["job_num"] == job, record
        assert "held-out accuracy" in (sweep / str(job) / "logs" / "rank0.log").read_text()
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="training steps per job (3000: ~10 s CPU)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp) / "my_app"
        shutil.copytree(
            ROOT / "examples" / "hydra_app", app, ignore=shutil.ignore_patterns("outputs", "multirun")
        )
        walls = {n_jobs: run_sweep(app, n_jobs, args.steps) for n_jobs in (1, 2)}
    print(f"4 one-rank jobs of {args.steps} steps, single-threaded, {cores} cores")
    print("| hydra.launcher.n_jobs | wall time (s) | vs one at a time |")
    print("|---:|---:|---:|")
    for n_jobs, wall in walls.items():
        print(f"| {n_jobs} | {wall:.1f} | {walls[1] / wall:.2f}x |")


if __name__ == "__main__":
    main()
