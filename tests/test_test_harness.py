"""The harness the tests stand on: worlds and jobs get more time on a busy machine, a job that runs past its
time is killed with everything it started, a process a test leaves running is killed after it, and a failure
is said as it happens, with what the machine has left."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import leftover_processes
import pytest
from launching import ROOT, job_env, run_job

from distsync import testing


def test_the_timeout_scale_is_the_setting_else_the_load_per_core(monkeypatch):
    monkeypatch.setenv(testing.TIMEOUT_SCALE_ENV, "3.5")
    assert testing.timeout_scale() == 3.5
    monkeypatch.setenv(testing.TIMEOUT_SCALE_ENV, "0.2")
    assert testing.timeout_scale() == 1.0  # never less time than on an idle machine
    monkeypatch.delenv(testing.TIMEOUT_SCALE_ENV)
    monkeypatch.setattr(testing.os, "getloadavg", lambda: (12.0, 0.0, 0.0))
    monkeypatch.setattr(testing.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert testing.timeout_scale() == 3.0
    monkeypatch.setattr(testing.os, "getloadavg", lambda: (1.0, 0.0, 0.0))
    assert testing.timeout_scale() == 1.0


def test_a_job_past_its_time_is_killed_with_the_processes_it_started(monkeypatch):
    """The grandchild keeps the output pipes open: killing only the child would leave this call waiting
    for it (60 s) after the timeout."""
    monkeypatch.setenv(testing.TIMEOUT_SCALE_ENV, "1")
    sleep = "import time; time.sleep(60)"
    script = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_job([sys.executable, "-c", script], cwd=".", timeout=2)
    assert time.monotonic() - start < 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper and /proc are Linux's")
def test_an_orphan_a_test_leaves_running_is_found_and_killed():
    """The shell exits at once; the sleep it started in the background is nobody's child but this one's."""
    before = leftover_processes.running_descendants()
    shell = subprocess.run(
        ["bash", "-c", "sleep 120 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    orphan = int(shell.stdout)
    assert orphan in leftover_processes.running_descendants()
    leaked = leftover_processes.kill_new(before)
    assert list(leaked) == [orphan] and leaked[orphan] == "sleep 120"
    assert orphan not in leftover_processes.running_descendants()
    with pytest.raises(ProcessLookupError):  # killed and reaped, not a zombie
        os.kill(orphan, 0)


@pytest.mark.skipif(not os.environ.get("DISTSYNC_TEST_PLANT_FAILURE"), reason="planted by the test below")
def test_planted_failure():
    raise AssertionError("the planted failure")


def test_a_failure_is_said_as_it_happens_with_what_the_machine_has_left():
    env = job_env(DISTSYNC_TEST_PLANT_FAILURE="1")  # job_env leaves out the caller's DISTSYNC_TEST_*
    node = f"{Path(__file__).name}::test_planted_failure"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        cwd=ROOT / "tests", env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout
    said = [
        line for line in proc.stdout.splitlines() if line.startswith("FAILED ") and f"{node} (call)" in line
    ]
    assert len(said) == 1 and "AssertionError: the planted failure" in said[0], proc.stdout
    assert re.search(r"\[free disk [\d.]+ GiB in .*, memory available [\d.]+ GiB, load", said[0]), said[0]
    assert proc.stdout.index(said[0]) < proc.stdout.index("= FAILURES =")  # before pytest's own report


def _dynamo_imported(rank, world_size):
    return "torch._dynamo" in sys.modules


def test_a_world_starts_with_dynamo_where_its_caller_had_imported_it():
    """Its ranks are forked from a server that imported it once (a test suite: DDP and torch's optimizers
    import it, about two seconds of CPU in every rank). The other side, a caller without dynamo and ranks
    without it, is test_compile's test_eager_training_never_imports_dynamo."""
    code = "import torch._dynamo, test_test_harness as m; print(m.testing.run_world(m._dynamo_imported, 2))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[True, True]"
