"""Hydra sweeper plugins driving launch/train.py: the Optuna sweeper optimizes the metric a job returns."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from launching import FAST, ROOT, SCRIPT, run_job

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")  # pip install -e ".[optuna]" (in ".[test]")


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
        "hydra/sweeper=optuna",
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
    assert "Best value" in proc.stdout + proc.stderr


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy 1.4's notes about 2.0
def test_optuna_study_storage_works_with_the_pinned_sqlalchemy(tmp_path):
    """hydra.sweeper.storage=sqlite:///... needs optuna 2.x's RDB storage, which SQLAlchemy 2 breaks."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(storage=storage, study_name="lr", direction="maximize")
    study.optimize(lambda trial: -((trial.suggest_float("lr", 0.01, 0.2) - 0.1) ** 2), n_trials=2)
    again = optuna.load_study(study_name="lr", storage=storage)  # what a resumed sweep does
    assert len(again.trials) == 2 and again.best_value == study.best_value
