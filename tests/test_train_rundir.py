"""One job per run directory: the second job fails at once and writes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from distsync.train import TrainConfig, TrainerConfig, run
from distsync.train.rundir import HELD_ENV, RunDirBusy, RunDirLock, held_by_launcher


def test_second_lock_fails_naming_the_holder(tmp_path):
    with RunDirLock(tmp_path / "run"):
        with pytest.raises(RunDirBusy) as error:
            RunDirLock(tmp_path / "run").acquire()
        assert f"pid {os.getpid()}" in str(error.value) and "hydra.run.dir" in str(error.value)
    RunDirLock(tmp_path / "run").acquire().release()  # free again once released


def test_lock_dies_with_its_process(tmp_path):
    holder = textwrap.dedent(
        f"""
        import time
        from distsync.train.rundir import RunDirLock
        RunDirLock({str(tmp_path)!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy):
            RunDirLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    RunDirLock(tmp_path).acquire().release()  # no stale lock after SIGKILL


def test_run_refuses_a_run_dir_in_use_and_writes_nothing(tmp_path):
    cfg = TrainConfig(trainer=TrainerConfig(max_steps=5, progress=False))
    with RunDirLock(tmp_path):
        with pytest.raises(RunDirBusy, match="is in use by pid"):
            run(cfg, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_second_job_is_refused_before_any_worker_starts(tmp_path, capsys):
    from distsync.train.hydra_app import launch

    cfg = TrainConfig(
        trainer=TrainerConfig(max_steps=5, max_restarts=3, monitor_interval=0.2, progress=False)
    )
    with RunDirLock(tmp_path), pytest.raises(SystemExit):
        launch(cfg, str(tmp_path))
    err = capsys.readouterr().err
    # Said once: no world was started, so the agent had nothing to restart.
    assert err.count("is in use by pid") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_a_launcher_can_hold_the_lock_for_its_workers(tmp_path, monkeypatch):
    monkeypatch.delenv(HELD_ENV, raising=False)
    cfg = TrainConfig(trainer=TrainerConfig(max_steps=2, log_every=1, progress=False))
    with RunDirLock(tmp_path, for_workers=True):
        assert held_by_launcher(tmp_path) and not held_by_launcher(tmp_path / "other")
        assert run(cfg, str(tmp_path))["steps"] == 2  # rank 0 does not lock it a second time
        with pytest.raises(RunDirBusy):
            RunDirLock(tmp_path).acquire()
    assert HELD_ENV not in os.environ


def test_a_filesystem_without_locks_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Lustre without -o flock answers flock with ENOSYS: one line naming the way out, no traceback."""
    import errno
    import fcntl

    from distsync.train.hydra_app import launch

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cfg = TrainConfig(trainer=TrainerConfig(max_steps=5, progress=False))
    with pytest.raises(SystemExit):
        launch(cfg, str(tmp_path))
    err = capsys.readouterr().err
    assert "without file locks" in err and "-o flock" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0


def test_a_refused_job_puts_back_the_record_of_the_job_that_trains(tmp_path, capsys):
    """Hydra writes each job's .hydra/ before the lock can refuse it: the holder's record comes back."""
    from distsync.train.hydra_app import launch
    from distsync.train.rundir import keep_hydra_record

    record = tmp_path / ".hydra"
    record.mkdir()
    (record / "overrides.yaml").write_text("- optim.lr=0.1\n")
    cfg = TrainConfig(trainer=TrainerConfig(max_steps=5, progress=False))
    with RunDirLock(tmp_path):
        keep_hydra_record(tmp_path)  # what the holder did when it started training
        (record / "overrides.yaml").write_text("- optim.lr=0.5\n")  # what Hydra wrote for the second job
        with pytest.raises(SystemExit):
            launch(cfg, str(tmp_path))
    assert "is in use by pid" in capsys.readouterr().err
    assert (record / "overrides.yaml").read_text() == "- optim.lr=0.1\n"
