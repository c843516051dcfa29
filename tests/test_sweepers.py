"""Hydra sweeper plugins driving launch/train.py: distsync_optuna optimizes the metric a job returns."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from launching import FAST, ROOT, SCRIPT, run_job

pytest.importorskip("optuna")  # pip install -e ".[optuna]" (in ".[test]")


def _override(job: Path, key: str) -> str:
    """The value of ``key`` among the overrides Hydra recorded for this job."""
    overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
    (value,) = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return value


@pytest.mark.slow
def test_optuna_sweeper_maximizes_the_returned_metric(tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "hydra/sweeper=distsync_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.direction=maximize",  # trainer.metric=accuracy (the default) is returned
        "hydra.sweeper.sampler.seed=0",
        "optim.lr=interval(0.01,0.2)",
        f"hydra.sweep.dir={sweep}",
        "trainer.max_steps=20",
        *FAST,
    ]
    proc = run_job([sys.executable, str(SCRIPT), *args], ROOT)
    assert proc.returncode == 0
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1"]
    summaries = {job.name: json.loads((job / "summary.json").read_text()) for job in jobs}
    for job in jobs:
        s = summaries[job.name]
        assert s["world_size"] == 2 and s["steps"] == 20 and s["bn_buffers_in_sync"] is True
        assert 0.01 <= float(_override(job, "optim.lr")) <= 0.2  # Optuna drew it from the interval
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best_job = max(jobs, key=lambda job: summaries[job.name]["accuracy"])
    assert results["best_value"] == pytest.approx(summaries[best_job.name]["accuracy"], rel=1e-12)
    if summaries["0"]["accuracy"] != summaries["1"]["accuracy"]:  # a tie leaves either lr the best
        assert results["best_params"]["optim.lr"] == pytest.approx(float(_override(best_job, "optim.lr")))
    assert "Best trial" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_packaged_job_reports_its_evaluations_and_stops_when_pruned(tmp_path):
    """Every evaluation reports trainer.metric to the study; a trial its pruner stops ends at that step on
    every rank, is marked pruned in the study, the job's summary and the sweep's summary."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "hydra/sweeper=distsync_optuna",
        "hydra/sweeper/pruner=threshold",
        "hydra.sweeper.pruner.lower=2.0",  # no accuracy is above 2: pruned at the first evaluation
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.direction=maximize",
        "optim.lr=interval(0.01,0.2)",
        f"hydra.sweep.dir={sweep}",
        "trainer.max_steps=40",
        *FAST,  # evaluations every 10 steps
    ]
    proc = run_job([sys.executable, str(SCRIPT), *args], ROOT)
    assert proc.returncode == 0
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["pruned_at_step"] == 10 and summary["steps"] == 10
    assert yaml.safe_load((sweep / "0" / "trial.yaml").read_text())["state"] == "PRUNED"
    assert "pruned at step 10" in (sweep / "sweep_summary.md").read_text()
    assert "**pruned** at step 10" in (sweep / "optuna_trials.md").read_text()
