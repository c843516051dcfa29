"""End to end: what a scheduler's SIGTERM, a Ctrl-C or a killed worker does to the commands of
launch/train.py (2 CPU ranks, tiny data): nothing trained is lost, and the run resumes exactly."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time

import pytest
from launching import FAST, ROOT, SCRIPT, job_env, metric_steps, run_job, summary
from paced_data import PACED


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


# No periodic checkpoint, no evaluation until the end: an interrupted run can only resume from what the
# signal made it save. A tiny CNN on data read at a fixed pace (tests/paced_data.py): still training when
# the signal comes, 5 s after the first logged step or more, on any machine.
INTERRUPTIBLE = [
    *PACED,
    "model.channels=[8,8]",
    "trainer.max_steps=100",
    "trainer.log_every=5",
    "trainer.eval_every=1000",
    "trainer.monitor_interval=0.2",
    "trainer.checkpoint_every=1000",
]


@pytest.fixture(scope="module")
def never_interrupted(tmp_path_factory) -> dict:
    """The summary of that job run straight through, once for the file: what every interrupted and resumed
    run of it must end with."""
    where = tmp_path_factory.mktemp("straight")
    args = [sys.executable, str(SCRIPT), f"hydra.run.dir={where / 'run'}", *INTERRUPTIBLE]
    assert run_job(args, where).returncode == 0
    return summary(where / "run")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_an_interrupt_saves_a_checkpoint_and_the_run_resumes_exactly(tmp_path, signum, never_interrupted):
    """Ctrl-C or a scheduler's SIGTERM: every rank saves the step it reached (no periodic checkpoint here),
    and the same run directory then finishes with the numbers of a run that was never interrupted."""
    run_dir = tmp_path / "run"
    args = [sys.executable, str(SCRIPT), f"hydra.run.dir={run_dir}", *INTERRUPTIBLE]
    with (tmp_path / "err").open("w") as err:
        env = job_env()
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signum)  # the launcher's agent passes SIGTERM on to the workers
        code = proc.wait(timeout=90)
    assert code == 128 + signum, (tmp_path / "err").read_text()[-3000:]
    (saved,) = (run_dir / "checkpoints").glob("step_*.pt")
    step = int(saved.stem.removeprefix("step_"))
    assert 5 <= step < 100 and step % 5 == 0  # at a logging step, after the signal
    assert (
        f"stopped by {signal.Signals(signum).name} at step {step}"
        in (run_dir / "logs" / "rank1.log").read_text()
    )
    assert run_job(args, tmp_path).returncode == 0
    resumed, reference = summary(run_dir), never_interrupted
    assert resumed["resumed_from_step"] == step and resumed["steps"] == 100
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
