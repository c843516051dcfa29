"""A sweep packed onto the machine vs one job at a time: ``hydra.launcher.n_jobs``, measured.

    python benchmarks/sweep_packing.py            # ~1.5 min on 2 cores; --steps 600 for a quick look
    python benchmarks/sweep_packing.py --base main --steps 100 --jobs 8   # job starts, main vs this checkout

Runs a copy of ``examples/hydra_app`` (outside the checkout, as a user's app) as a sweep of 4 one-rank jobs
through ``hydra/launcher=torchrun``, each job training the app's MLP single-threaded (``OMP_NUM_THREADS=1``)
for about 10 s of CPU: once with ``hydra.launcher.n_jobs=1`` and once with ``n_jobs=2`` (two jobs at a time,
each on its own cores), in one invocation, then prints the wall times side by side, and how long a job's
devices stay free: from a job's last line to the first line of the next job on its cores (median and max
over the sweep; :mod:`_job_starts`). Both sweeps must return every job's value; the script checks that each
job wrote its record and ended training. ``--base REV`` runs the same sweeps with distsync of git revision
``REV`` too, interleaved, for a before/after in one run.
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

from _job_starts import checkout_of, describe, env_running, log_time, slot_gaps
from _revisions import ROOT


def run_sweep(app: Path, checkout: Path, n_jobs: int, steps: int, jobs: int) -> tuple[float, list[float]]:
    """Wall seconds of the sweep with ``n_jobs`` at a time, and the gaps between jobs on a slot; raises if
    a job did not finish."""
    sweep = app / f"multirun-{n_jobs}-{checkout.name}"
    lrs = ",".join(f"{0.05 * (k + 1):.2f}" for k in range(jobs))
    args = [
        sys.executable,
        "app.py",
        "-m",
        "hydra/launcher=torchrun",
        "hydra.launcher.nproc_per_node=1",
        f"hydra.launcher.n_jobs={n_jobs}",
        f"lr={lrs}",
        f"steps={steps}",
        f"eval_every={steps}",
        "model.hidden=256",
        "batch_size=256",
        f"hydra.sweep.dir={sweep}",
    ]
    env = env_running(checkout, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=app, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"the n_jobs={n_jobs} sweep failed:\n{proc.stderr[-3000:]}")
    records = []
    for job in range(jobs):
        record = json.loads((sweep / str(job) / "rank0.json").read_text())
        assert record["job_num"] == job, record
        lines = (sweep / str(job) / "logs" / "rank0.log").read_text().splitlines()
        assert "held-out accuracy" in lines[-1], lines[-3:]
        first = next(line for line in lines if "rank 0 of a" in line)
        records.append({"start": log_time(first), "end": log_time(lines[-1]), "slot": tuple(record["cores"])})
    return wall, slot_gaps(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="training steps per job (3000: ~10 s CPU)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs in the sweep")
    parser.add_argument("--base", help="a git revision whose distsync runs the same sweeps, for comparison")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp) / "my_app"
        shutil.copytree(
            ROOT / "examples" / "hydra_app", app, ignore=shutil.ignore_patterns("outputs", "multirun")
        )
        versions = [("this checkout", ROOT)]
        if args.base:
            versions.insert(0, (args.base, checkout_of(args.base, Path(tmp) / "base")))
        for n_jobs in (1, 2):  # the versions interleaved: the machine's load falls on both alike
            for name, checkout in versions:
                wall, gaps = run_sweep(app, checkout, n_jobs, args.steps, args.jobs)
                rows.append((name, n_jobs, wall, gaps))
    print(f"{args.jobs} one-rank jobs of {args.steps} steps, single-threaded, {cores} cores")
    gap = "job end -> next job's first line (s), median (max)"
    print(f"| distsync | hydra.launcher.n_jobs | wall time (s) | vs one at a time | {gap} |")
    print("|---|---:|---:|---:|---:|")
    for name, n_jobs, wall, gaps in rows:
        one_at_a_time = next(w for v, n, w, _ in rows if v == name and n == 1)
        print(f"| {name} | {n_jobs} | {wall:.1f} | {one_at_a_time / wall:.2f}x | {describe(gaps)} |")


if __name__ == "__main__":
    main()
