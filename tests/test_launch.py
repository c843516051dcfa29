"""End to end: the commands of launch/train.py as subprocesses, with 2 CPU ranks, few steps, tiny data."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from launching import (
    FAST,
    ROOT,
    SCRIPT,
    TORCHRUN,
    metric_steps,
    run_job,
    summary,
)


@pytest.mark.slow
def test_single_run_from_repo_root(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_job(
        [sys.executable, "launch/train.py", f"hydra.run.dir={run_dir}", "trainer.max_steps=20", *FAST], ROOT
    )
    assert proc.returncode == 0
    s = summary(run_dir)
    assert s["world_size"] == 2 and s["steps"] == 20
    assert s["bn_buffers_in_sync"] is True
    assert s["restarts"] == 0 and s["resumed_from_step"] is None
    assert s["accuracy"] > 0.5 and s["final_loss"] < 2.3
    assert s["wall_seconds"] > 0
    assert metric_steps(run_dir, "train") == [5, 10, 15, 20]
    assert metric_steps(run_dir, "eval") == [10, 20]
    assert (run_dir / "curves.png").stat().st_size > 0
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] != []
    assert "step=20" in (run_dir / "logs" / "rank1.log").read_text()
    assert proc.stdout.count("step=20 ") == 1  # only rank 0 talks to the console


@pytest.mark.slow
def test_external_torchrun_from_another_cwd(tmp_path):
    proc = run_job([*TORCHRUN, "trainer.max_steps=10", *FAST], tmp_path)
    assert proc.returncode == 0
    run_dirs = [p.parent for p in tmp_path.glob("outputs/*/*/summary.json")]
    assert len(run_dirs) == 1, list(tmp_path.rglob("*"))  # one run directory for both ranks
    assert len(list(tmp_path.rglob(".hydra"))) == 1
    run_dir = run_dirs[0]
    assert summary(run_dir)["world_size"] == 2 and summary(run_dir)["steps"] == 10
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert proc.stdout.count("step=10 ") == 1


@pytest.mark.slow
def test_external_torchrun_refuses_multirun(tmp_path):
    proc = run_job([*TORCHRUN, "-m", "optim.lr=0.1,0.2"], tmp_path, timeout=90)
    assert proc.returncode != 0
    assert proc.stderr.count("cannot run under an external torchrun") == 1
    assert not list(tmp_path.rglob("summary.json"))


@pytest.mark.slow
def test_sweep_runs_one_world_per_job_and_goes_on_past_a_failed_one(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "optim.lr=0.1,inf,0.05", "trainer.max_steps=10", f"hydra.sweep.dir={sweep}", *FAST]
    proc = run_job([sys.executable, str(SCRIPT), *args], tmp_path)
    assert proc.returncode != 0  # a job failed: the sweep says so at the end
    # Said when the job fails, and again in Hydra's report at the end of the sweep: no traceback
    assert proc.stderr.count("Error: optim.lr must be finite (got inf)\n") == 1
    assert "Traceback" not in proc.stderr
    report = proc.stderr[proc.stderr.index("Error executing job") :].splitlines()
    assert report[:2] == [
        "Error executing job with overrides: ['optim.lr=inf', 'trainer.max_steps=10', " + repr(FAST)[1:],
        "optim.lr must be finite (got inf)",
    ]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1", "2"]
    assert not (jobs[1] / "summary.json").exists()
    for job, lr in zip([jobs[0], jobs[2]], ["0.1", "0.05"], strict=True):
        assert summary(job)["steps"] == 10 and summary(job)["world_size"] == 2
        assert f"optim.lr={lr}" in (job / ".hydra" / "overrides.yaml").read_text()
    # The sweep's summary across its jobs, the failed one included
    rows = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [(r["job"], r["status"]) for r in rows] == [("0", "done"), ("1", "failed"), ("2", "done")]
    assert rows[0]["accuracy"] == summary(jobs[0])["accuracy"] and "optim.lr=0.05" in rows[2]["overrides"]
    assert f"sweep summary (rewritten as each job ends): {sweep / 'sweep_summary.md'}" in proc.stdout
    table = (sweep / "sweep_summary.md").read_text().splitlines()
    assert table[0] == "Overrides of every job: " + " ".join(["trainer.max_steps=10", *FAST])
    assert len(table) == 2 + 2 + 3 and "| 1 | optim.lr=inf | failed |" in table[5]
    assert (sweep / "sweep_curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_external_torchrun_honours_the_run_dir_of_a_config_file(tmp_path):
    (tmp_path / "exps").mkdir()
    (tmp_path / "exps" / "exp.yaml").write_text(
        "defaults:\n  - config\n  - _self_\nhydra:\n  run:\n    dir: runs/exp1\n"
    )
    args = ["--config-dir", "exps", "--config-name", "exp", "trainer.max_steps=5", *FAST]
    proc = run_job([*TORCHRUN, *args], tmp_path)
    assert proc.returncode == 0
    assert summary(tmp_path / "runs" / "exp1")["world_size"] == 2
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_rerun_with_another_model_is_refused_once_without_restarts(tmp_path):
    run_dir = tmp_path / "run"
    first = [sys.executable, str(SCRIPT), f"hydra.run.dir={run_dir}", "trainer.max_steps=10", *FAST]
    assert run_job(first, tmp_path).returncode == 0
    proc = run_job([*first, "model.channels=[8,8]", "trainer.max_restarts=3"], tmp_path, timeout=60)
    assert proc.returncode != 0
    # Said once, by the launcher: no world was started, so the agent had nothing to restart.
    assert proc.stderr.count("model.channels: [32, 64, 64] -> [8, 8]") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (run_dir / "summary.json").exists()  # the refused job's directory was the earlier run's
    # Hydra's record in it still describes the run that trained there, not the refused job
    assert "model.channels" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["model"]["channels"] == [
        32,
        64,
        64,
    ]


@pytest.mark.slow
def test_external_torchrun_jobs_refused_leave_the_trained_record(tmp_path):
    """Under torchrun the workers take the run-dir lock; a refused job puts the holder's .hydra back."""
    from distsync.train.rundir import RunDirLock

    run_dir = tmp_path / "run"
    first = [*TORCHRUN, f"hydra.run.dir={run_dir}", "trainer.max_steps=10", *FAST]
    assert run_job(first, tmp_path).returncode == 0
    record = {p.name: p.read_text() for p in (run_dir / ".hydra").glob("*.yaml")}
    with RunDirLock(run_dir):  # as if another job were training there
        busy = run_job([*first, "optim.lr=0.05"], tmp_path, timeout=90)
    assert busy.returncode != 0 and "is in use by" in busy.stderr
    refused = run_job([*first, "model.channels=[8,8]"], tmp_path, timeout=90)
    assert refused.returncode != 0 and "model.channels: [32, 64, 64] -> [8, 8]" in refused.stderr
    assert {p.name: p.read_text() for p in (run_dir / ".hydra").glob("*.yaml")} == record


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.nproc_per_node=0", "trainer.nproc_per_node"),
        ("trainer.max_steps=???", "trainer.max_steps"),
        ("model.norm=bogus", "model.norm"),
        ("+trainer.foo=1", "trainer.foo"),
    ],
)
def test_bad_override_exits_with_a_short_message(tmp_path, override, key):
    proc = run_job(
        [sys.executable, str(SCRIPT), f"hydra.run.dir={tmp_path / 'run'}", override], tmp_path, timeout=60
    )
    assert proc.returncode != 0
    error, *rest = proc.stderr.splitlines()
    assert error.startswith("Error: ") and key in error and rest == [], proc.stderr  # one line
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()  # the run directory Hydra made for this job alone, removed


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.nproc_per_node=abc", "full_key: trainer.nproc_per_node"),
        ("trainer.bogus=1", "Could not override 'trainer.bogus'"),
        ("optim=nosuch", "Could not find 'optim/nosuch'"),
    ],
)
def test_an_override_hydra_cannot_apply_is_hydras_error(tmp_path, override, words):
    proc = run_job(
        [sys.executable, str(SCRIPT), f"hydra.run.dir={tmp_path / 'run'}", override], tmp_path, timeout=60
    )
    assert proc.returncode != 0
    assert words in proc.stderr and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert not (tmp_path / "run").exists()  # Hydra composes before it makes the run directory


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.backend=mpi", "trainer.backend must be one of"),
        ("data.batch_size=100000", "data.batch_size must be at most"),
        ("trainer.rdzv_endpoint=localhost:abc", "must be an integer"),
        ("trainer.nproc_per_node=1 model.norm=torch", "nn.SyncBatchNorm, which needs CUDA"),
    ],
)
def test_a_refusal_after_hydra_made_the_run_dir_leaves_nothing_behind(tmp_path, override, words):
    proc = run_job([sys.executable, str(SCRIPT), *override.split()], tmp_path, timeout=60)
    assert proc.returncode != 0
    error, *rest = proc.stderr.splitlines()
    assert error.startswith("Error: ") and words in error and rest == [], proc.stderr
    assert not (tmp_path / "outputs").exists()  # Hydra's outputs/<date>/<time>/.hydra, removed


def test_a_sweep_value_hydra_cannot_compose_is_refused_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    args = [sys.executable, str(SCRIPT), "-m", "optim.lr=0.05,foo", f"hydra.sweep.dir={sweep}", "+bogus=1,2"]
    proc = run_job(args, tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "Value 'foo' of type 'str' could not be converted to Float" in proc.stderr, proc.stderr
    assert "full_key: optim.lr" in proc.stderr
    assert not (sweep / "0").exists()  # Hydra composes every job of the batch before it runs one
    proc = run_job([*args[:3], "optim.lr=0.05", *args[4:]], tmp_path, timeout=60)
    assert proc.returncode != 0  # an unknown key fails each job, before any worker starts
    assert proc.stderr.count("Error: bogus: not a key of the training config") == 2, proc.stderr


def test_full_error_shows_the_traceback(tmp_path):
    args = [sys.executable, str(SCRIPT), f"hydra.run.dir={tmp_path / 'run'}", "trainer.nproc_per_node=0"]
    proc = run_job(args, tmp_path, timeout=60, HYDRA_FULL_ERROR="1")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "trainer.nproc_per_node" in proc.stderr
