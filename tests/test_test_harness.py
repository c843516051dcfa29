"""The harness the tests stand on: worlds and jobs get more time on a busy machine, and a job that runs past
its time is killed with everything it started."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from launching import run_job

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
