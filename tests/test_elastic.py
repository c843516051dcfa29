"""distsync.launch and the hydra/launcher=torchrun plugin, alone and through the example app.

The example is copied outside the checkout and run as a user would: a single run, a sweep through the
plugin, an Optuna sweep and a sweep with a failing job.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from elastic_fns import fail_on_rank_one, flush_at_exit, rank_and_config
from launching import ROOT, run_job

import distsync
from distsync.elastic import LaunchError


def test_launch_runs_in_process_under_an_elastic_agent(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distsync.launch(rank_and_config, {"a": 1}, nproc_per_node=2) == (3, 4, {"a": 1})


def test_launch_returns_rank_zeros_value(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert distsync.launch(rank_and_config, {"a": 1}, nproc_per_node=2) == (0, 2, {"a": 1})


def test_a_failing_worker_raises_launch_error_naming_it(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(LaunchError, match="rank 1: ValueError: rank one refuses") as caught:
        distsync.launch(fail_on_rank_one, None, nproc_per_node=2)
    assert list(caught.value.failures) == [1]


@pytest.mark.parametrize(("fn", "expected"), [("keep_until_exit", "result 0"), ("fail_holding", "failed [")])
def test_workers_end_without_interpreter_teardown(fn, expected):
    """A worker ends once its result or error is reported: a release that would block in interpreter
    teardown (a gloo group freed late, pytorch#190489) cannot hang the launch."""
    code = f"import elastic_fns; elastic_fns.launch_and_print({fn!r})"
    proc = run_job([sys.executable, "-c", code], cwd=Path(__file__).parent, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines()[-1].startswith(expected)


def test_exit_handlers_of_the_workers_still_run(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert distsync.launch(flush_at_exit, str(tmp_path / "flushed"), nproc_per_node=2) == "registered"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flushed.0", "flushed.1"]


def test_bad_options_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="nnodes must be N or MIN:MAX"):
        distsync.launch(rank_and_config, None, nnodes="two")
    with pytest.raises(ValueError, match="rdzv_endpoint must be host:port"):
        distsync.launch(rank_and_config, None, nnodes=2)


# ------------------------------------------------------------------------------------- the example app


@pytest.fixture
def app(tmp_path) -> Path:
    """The example app, copied outside the checkout: it runs against the installed distsync."""
    copy = tmp_path / "my_app"
    ignore = shutil.ignore_patterns("outputs", "multirun")
    shutil.copytree(ROOT / "examples" / "hydra_app", copy, ignore=ignore)
    return copy


def _run_app(app: Path, *args: str):
    return run_job([sys.executable, "app.py", *args, "steps=10"], cwd=app, timeout=240)


def _job_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("**/rank0.json"))


def _check_job(job: Path, world_size: int = 2) -> dict:
    """One run dir for the job: every rank's record in it, identical but for the pid, and per-rank logs."""
    records = [json.loads((job / f"rank{r}.json").read_text()) for r in range(world_size)]
    for record in records:
        record.pop("pid")
    assert all(record == records[0] for record in records), records
    assert records[0]["world_size"] == world_size
    assert Path(records[0]["output_dir"]) == job.resolve()
    assert (job / "logs" / f"rank{world_size - 1}.log").exists()
    return records[0]


def _accuracy(job: Path) -> float:
    return float(re.findall(r"held-out accuracy ([\d.]+)", (job / "logs" / "rank0.log").read_text())[-1])


@pytest.mark.slow
def test_example_single_run_is_a_two_rank_world(app):
    proc = _run_app(app)
    assert proc.returncode == 0
    (job,) = _job_dirs(app / "outputs")
    record = _check_job(job)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\.\d{6}", record["config"]["started"])
    assert _accuracy(job) > 0.8


@pytest.mark.slow
def test_example_sweep_through_the_plugin(app):
    proc = _run_app(app, "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "lr=0.05,0.2")
    assert proc.returncode == 0
    jobs = _job_dirs(app / "multirun")
    assert len(jobs) == 2
    records = [_check_job(job) for job in jobs]
    assert [r["config"]["lr"] for r in records] == [0.05, 0.2]
    assert [r["job_num"] for r in records] == [0, 1]


@pytest.mark.slow
def test_example_optuna_sweep_gets_rank_zeros_value(app):
    proc = _run_app(
        app,
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.direction=maximize",
        "lr=interval(0.01,0.3)",
    )
    assert proc.returncode == 0
    jobs = _job_dirs(app / "multirun")
    assert len(jobs) == 2
    for job in jobs:
        _check_job(job)
    (results,) = (app / "multirun").glob("**/optimization_results.yaml")
    best = yaml.safe_load(results.read_text())["best_value"]
    assert best == pytest.approx(max(_accuracy(job) for job in jobs), abs=1e-3)


@pytest.mark.slow
def test_example_sweep_through_submitit_local(app):
    """submitit's local executor (what hydra/launcher=submitit_slurm runs on a cluster) starts each job in
    its own process, which scans Hydra's plugins again: the job's config must still reach the ranks."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = _run_app(app, "-m", "hydra/launcher=submitit_local", "lr=0.05,0.2")
    assert proc.returncode == 0
    records = [_check_job(job) for job in _job_dirs(app / "multirun")]
    assert [r["config"]["lr"] for r in records] == [0.05, 0.2]
    assert _accuracy(_job_dirs(app / "multirun")[0]) > 0.5


@pytest.mark.slow
def test_a_failing_job_fails_alone_and_the_sweep_exits_non_zero(app):
    plugin = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"]
    proc = _run_app(app, "-m", *plugin, "fail_on_rank=1,-1")
    assert proc.returncode != 0
    assert "rank 1: RuntimeError: rank 1 fails on purpose" in proc.stderr
    jobs = _job_dirs(app / "multirun")
    assert len(jobs) == 2  # the job after the failing one still ran
    assert _accuracy(jobs[1]) > 0.8


def test_the_plugin_is_found_by_hydra(app):
    proc = run_job([sys.executable, "app.py", "--info", "plugins"], cwd=app)
    assert proc.returncode == 0
    assert "TorchrunLauncher" in proc.stdout
