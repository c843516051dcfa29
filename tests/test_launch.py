"""End to end: the commands of launch/train.py as subprocesses, with 2 CPU ranks, few steps, tiny data."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml
from launching import (
    EXAMPLE_APP,
    FAST,
    ROOT,
    SCRIPT,
    TORCHRUN,
    copy_example_app,
    job_env,
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
def test_sigterm_stops_the_whole_sweep_and_leaves_the_job_resumable(tmp_path):
    """A scheduler's SIGTERM (or Ctrl-C) ends the sweep, not just its current job; the command printed
    resumes it."""
    sweep = tmp_path / "sweep"
    job = ["trainer.max_steps=200", *FAST]
    args = [sys.executable, str(SCRIPT), "-m", "optim.lr=0.1,0.05", f"hydra.sweep.dir={sweep}", *job]
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, env=job_env(), stdout=out, stderr=err)
        deadline = time.monotonic() + 120
        while not list((sweep / "0").glob("checkpoints/step_*.pt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    stderr = (tmp_path / "err").read_text()
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]  # no further job started
    assert not (sweep / "0" / "summary.json").exists()
    # The command printed at the start and at the signal resumes the sweep: job 0 from its checkpoint
    resume = [line for line in stderr.splitlines() if line.startswith("to resume: ")]
    assert len(resume) == 1 and f"resume it with: {resume[0].removeprefix('to resume: ')}" in stderr
    assert run_job(shlex.split(resume[0].removeprefix("to resume: ")), tmp_path).returncode == 0
    assert summary(sweep / "0")["resumed_from_step"] >= 10
    assert summary(sweep / "1")["resumed_from_step"] is None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_an_interrupt_saves_a_checkpoint_and_the_run_resumes_exactly(tmp_path, signum):
    """Ctrl-C or a scheduler's SIGTERM: every rank saves the step it reached (no periodic checkpoint here),
    and the same run directory then finishes with the numbers of a run that was never interrupted."""
    job = [
        "trainer.max_steps=400",
        "trainer.log_every=5",
        "trainer.eval_every=1000",
        "trainer.monitor_interval=0.2",
    ]
    job.append("trainer.checkpoint_every=1000")
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    assert run_job([sys.executable, str(SCRIPT), f"hydra.run.dir={straight}", *job], tmp_path).returncode == 0
    args = [sys.executable, str(SCRIPT), f"hydra.run.dir={run_dir}", *job]
    with (tmp_path / "err").open("w") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signum)  # the launcher's agent passes SIGTERM on to the workers
        code = proc.wait(timeout=90)
    assert code == 128 + signum, (tmp_path / "err").read_text()[-3000:]
    (saved,) = (run_dir / "checkpoints").glob("step_*.pt")
    step = int(saved.stem.removeprefix("step_"))
    assert 5 <= step < 400 and step % 5 == 0  # at a logging step, after the signal
    assert (
        f"stopped by {signal.Signals(signum).name} at step {step}"
        in (run_dir / "logs" / "rank1.log").read_text()
    )
    assert run_job(args, tmp_path).returncode == 0
    resumed, reference = summary(run_dir), summary(straight)
    assert resumed["resumed_from_step"] == step and resumed["steps"] == 400
    for key in ("final_loss", "accuracy", "eval_loss"):
        assert resumed[key] == reference[key], key


@pytest.mark.slow
def test_killed_worker_is_restarted_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"hydra.run.dir={run_dir}", "trainer.max_steps=30", "trainer.max_restarts=2", *FAST]
    proc = run_job([sys.executable, str(SCRIPT), *args], ROOT, DISTSYNC_TEST_KILL_AT_STEP="15")
    assert proc.returncode == 0
    assert "SIGKILL" in proc.stderr  # the agent saw the worker die
    s = summary(run_dir)
    assert s["restarts"] >= 1
    assert s["resumed_from_step"] == 10
    assert s["steps"] == 30
    assert s["bn_buffers_in_sync"] is True
    steps = metric_steps(run_dir, "train")
    assert steps == sorted(set(steps)) == [5, 10, 15, 20, 25, 30]  # the killed attempt's extra rows are gone
    assert "resumed from" in (run_dir / "logs" / "rank1.log").read_text()


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
        ("trainer.nproc_per_node=abc", "trainer.nproc_per_node"),
        ("trainer.nproc_per_node=0", "trainer.nproc_per_node"),
        ("trainer.max_steps=???", "trainer.max_steps"),
        ("model.norm=bogus", "model.norm"),
        ("trainer.bogus=1", "trainer.bogus"),
        ("+trainer.foo=1", "trainer.foo"),
        ("optim=nosuch", "optim/nosuch' (available options in 'optim': adamw, sgd)"),
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
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run directory


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
    assert proc.stderr.splitlines() == [
        "Error: optim.lr: Value 'foo' of type 'str' could not be converted to Float"
    ], proc.stderr
    assert not sweep.exists()  # no job ran
    proc = run_job([*args[:3], "optim.lr=0.05", *args[4:]], tmp_path, timeout=60)
    assert proc.stderr.splitlines() == ["Error: bogus: not a key of the training config"], proc.stderr


def test_full_error_shows_the_traceback(tmp_path):
    args = [sys.executable, str(SCRIPT), f"hydra.run.dir={tmp_path / 'run'}", "trainer.nproc_per_node=0"]
    proc = run_job(args, tmp_path, timeout=60, HYDRA_FULL_ERROR="1")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "trainer.nproc_per_node" in proc.stderr


@pytest.mark.slow
def test_the_wheel_alone_runs_the_training_job(tmp_path):
    """The wheel built and installed as the README says (``pip wheel --no-deps -w dist .``, then
    ``pip install "dist/distsync-*.whl[train,optuna]"``; no checkout: no conf/, no launch/) is enough for
    distsync-train.

    The new environment gets its dependencies (torch, Hydra, ...) from this one through a ``.pth`` line,
    which adds this environment's packages but not the checkout that its editable install points to
    (``.pth`` files of a directory added that way are not run): installing torch again took half a minute.
    pip sees them there, so the install with extras resolves every requirement without an index.
    """
    wheels, venv, work = tmp_path / "wheels", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    quiet = ["-q", "--disable-pip-version-check"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", "-w", wheels, ROOT], check=True
    )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(packages) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (wheel,) = wheels.glob("distsync-*.whl")
    install = [sys.executable, "-m", "pip", "--python", python, "install", *quiet, "--no-index"]
    subprocess.run([*install, f"{wheel}[train,optuna]"], check=True)
    where = subprocess.run(
        [python, "-c", "import distsync; print(distsync.__file__)"], cwd=work, capture_output=True
    )
    assert str(ROOT) not in where.stdout.decode() and str(venv) in where.stdout.decode()  # not the checkout
    check = run_job([python, "-m", "distsync.check", "--nproc", "2"], work)
    assert check.returncode == 0 and "12 passed, 0 failed" in check.stdout
    help_text = run_job([venv / "bin" / "distsync-train", "--help"], work).stdout
    assert "trainer: default, fast" in help_text
    (doc,) = re.findall(r"Every key is described in (\S+)\.\n", help_text)
    assert Path(doc).read_text().startswith("# Training") and str(venv) in doc  # installed with the wheel
    run_dir = work / "run"
    proc = run_job(
        [venv / "bin" / "distsync-train", f"hydra.run.dir={run_dir}", "trainer.max_steps=10", *FAST], work
    )
    assert proc.returncode == 0
    assert summary(run_dir)["steps"] == 10 and summary(run_dir)["world_size"] == 2

    # The same job under an external torchrun, as a module of the wheel: every rank in one run dir.
    torchrun = [python, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "distsync.train"]
    run_dir = work / "torchrun"
    proc = run_job([*torchrun, f"hydra.run.dir={run_dir}", "trainer.max_steps=6", *FAST], work)
    assert proc.returncode == 0
    assert summary(run_dir)["steps"] == 6 and summary(run_dir)["world_size"] == 2

    # A user's own app, copied out of the checkout, finds the wheel's hydra/launcher=torchrun plugin.
    app = copy_example_app(work / "my_app")
    plugin = ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "lr=0.05,0.2", "steps=5"]
    proc = run_job([python, "app.py", *plugin], app)
    assert proc.returncode == 0
    jobs = sorted(p.parent for p in (app / "multirun").glob("*/*/*/rank1.json"))
    assert len(jobs) == 2 and all((job / "rank0.json").exists() for job in jobs)


def _readme_commands(readme: Path) -> list[list[str]]:
    """The commands of a README's bash block that run the app (``python``, ``torchrun``): continued lines
    joined, comments left out, the install line too."""
    block = re.search(r"```bash\n(.*?)```", readme.read_text(), re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] in (["python"], ["torchrun"]):
            commands.append(words)
    return commands


def _files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.mark.slow
def test_the_example_apps_readme_commands_leave_nothing_the_tests_copy(tmp_path):
    """Whoever follows examples/hydra_app/README.md inside the checkout leaves Hydra's run and sweep folders
    in the app's folder: the tests copy the app without them, so their runs find their own jobs only."""
    pristine = copy_example_app(tmp_path / "pristine")
    used = copy_example_app(tmp_path / "used")
    commands = _readme_commands(EXAMPLE_APP / "README.md")
    assert len(commands) >= 5 and any(words[0] == "torchrun" for words in commands), commands
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    for words in commands:
        program = [sys.executable] if words[0] == "python" else torchrun
        proc = run_job([*program, *words[1:], "steps=2"], used, timeout=240)
        assert proc.returncode == 0, shlex.join(words)
    assert {"outputs", "multirun"} <= {path.name for path in used.iterdir()}
    assert _files(copy_example_app(tmp_path / "copy", source=used)) == _files(pristine)
