"""A Lightning + Hydra project in the template's shape (tests/lightning_template), run as its users run it.

Its hydra node interpolates the task config everywhere (run and sweep dirs from ``${paths.log_dir}`` and
``${task_name}``, a job name from ``${oc.env:...}``, the job log ``${task_name}.log``), its ``extras`` and
ranked logger are rank-zero-only, its LightningModule holds torchmetrics metrics and batch norm.
"""

import shutil
import sys
from pathlib import Path

import _vision
import pytest
import yaml
from launching import ROOT, run_job

pytest.importorskip("lightning")
TEMPLATE = ROOT / "tests" / "lightning_template"
TORCHRUN = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"]
DDP = ["trainer=ddp_cpu_or_gpu", "+plugin=distsync"]


@pytest.fixture
def project(tmp_path) -> Path:
    copy = tmp_path / "project"
    shutil.copytree(TEMPLATE, copy, ignore=shutil.ignore_patterns("logs", "__pycache__"))
    return copy


def _train(project: Path, *overrides: str):
    return run_job(
        [sys.executable, "train.py", *overrides], project, timeout=240,
        PYTHONPATH=_vision.python_path(), TEMPLATE_JOB_SUFFIX="probe",
    )  # fmt: skip


def _jobs(project: Path, kind: str) -> list[Path]:
    """The job directories the template's hydra node names: logs/train/<kind>/<time>[/<num>]."""
    return sorted(p.parent for p in (project / "logs" / "train" / kind).glob("**/tags.log"))


def _check_job(job: Path, world_size: int) -> None:
    """The job log named by ${task_name}, rank-zero-only files written once, the workers' HydraConfig."""
    assert (job / "train.log").exists()
    assert (job / "tags.log").read_text().splitlines() == ["['dev']"]  # extras ran on rank 0 alone
    assert (job / "config_tree.log").read_text().count("task_name: train") == 1
    if world_size > 1:
        rank0, rank1 = ((job / "logs" / f"rank{r}.log").read_text() for r in (0, 1))
        assert f"[rank: 0] fitting job train_probe in {job}" in rank0
        assert "fitting" not in rank1  # the ranked logger is rank-zero-only on rank 1 too


@pytest.mark.slow
def test_lightnings_own_ddp_with_the_plugin(project):
    proc = _train(project, *DDP)
    assert proc.returncode == 0
    (job,) = _jobs(project, "runs")
    _check_job(job, 1)


@pytest.mark.slow
def test_a_sweep_of_torchrun_worlds_through_the_launcher(project):
    proc = _train(project, "-m", *TORCHRUN, *DDP, "model.lr=0.001,0.003")
    assert proc.returncode == 0
    jobs = _jobs(project, "multiruns")
    assert [job.name for job in jobs] == ["0", "1"]  # hydra.sweep.subdir
    for job in jobs:
        _check_job(job, 2)


@pytest.mark.slow
@pytest.mark.parametrize("sweep", [False, True], ids=["single run", "sweep"])
def test_distsync_launch_from_the_task_function(project, sweep):
    proc = _train(project, *(["-m", "model.lr=0.001,0.003"] if sweep else []), "launch_nproc=2", *DDP)
    assert proc.returncode == 0
    jobs = _jobs(project, "multiruns" if sweep else "runs")
    assert len(jobs) == (2 if sweep else 1)
    for job in jobs:
        _check_job(job, 2)


@pytest.mark.slow
def test_a_trainer_that_does_not_run_the_launched_world_is_refused_on_every_rank(project):
    """The template's default trainer (devices: 1) in 2-rank worlds: two independent fits, refused."""
    proc = _train(project, "-m", *TORCHRUN, "model.lr=0.001")
    assert proc.returncode != 0
    assert "torchrun world of 2" in proc.stderr and "devices=1" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="packs two jobs on two cores")
def test_an_optuna_search_packed_two_worlds_at_a_time(project):
    proc = _train(project, "-m", "hparams_search=optuna", *TORCHRUN, "hydra.launcher.n_jobs=2", *DDP)
    assert proc.returncode == 0
    jobs = _jobs(project, "multiruns")
    assert len(jobs) == 2
    for job in jobs:
        _check_job(job, 2)
    (results,) = (project / "logs").glob("**/optimization_results.yaml")
    assert 0.0 < yaml.safe_load(results.read_text())["best_value"] <= 1.0
