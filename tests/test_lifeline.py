"""Workers die with the process that started them, even when it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from leftover_processes import alive, running_descendants

from distsync.testing import timeout_scale

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` still alive after ``seconds`` (longer on a loaded machine: a dying worker's
    lifeline thread waits for a core like everything else)."""
    deadline = time.monotonic() + seconds * timeout_scale()
    while time.monotonic() < deadline:
        running = [p for p in pids if alive(p)]
        if not running:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("mechanism", ["pdeathsig", "watchdog"])
def test_child_dies_with_its_sigkilled_parent(mechanism):
    child = textwrap.dedent(
        f"""
        import time
        from distsync.launching import lifeline
        if {mechanism == "watchdog"}:
            lifeline._PR_SET_PDEATHSIG = 0  # an invalid prctl option: the watchdog thread alone
        lifeline.die_with_parent(poll_interval=0.2)
        print("armed", flush=True)
        time.sleep(60)
        """
    )
    parent = textwrap.dedent(
        f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "armed"
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child_pid = int(proc.stdout.readline())
    try:
        assert alive(child_pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _wait_gone([child_pid], 3.0) == []
    finally:
        _kill_all([child_pid])


@pytest.mark.parametrize("mechanism", ["pdeathsig", "watchdog"])
@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_multiprocessing_child_dies_with_the_process_that_started_it(start_method, mechanism):
    """Whatever the start method: under forkserver the child's OS parent is the fork server, yet the
    lifeline watches the process that started it (before: the child SIGKILLed itself at once)."""
    code = f"import elastic_fns; elastic_fns.start_armed_child({start_method!r}, {mechanism == 'watchdog'})"
    tests = Path(__file__).parent
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tests, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    child = int(line) if line.isdigit() else None
    try:
        assert child is not None, f"the child did not arm its lifeline: {line!r}"
        time.sleep(1.0)
        assert alive(child)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _wait_gone([child], 5.0) == []
    finally:
        proc.kill()
        proc.wait()
        _kill_all([child] if child else [])


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_workers_die_when_the_job_is_sigkilled(tmp_path, launcher):
    """The agent is ``python launch/train.py`` itself (its workers come from torch.multiprocessing, whose
    own PDEATHSIG is a SIGINT that a worker inside a collective never acts on), or ``torchrun`` (plain
    subprocesses, no PDEATHSIG at all)."""
    run_dir = tmp_path / "run"
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node=2"] if launcher == "torchrun" else []
    args = [
        sys.executable,
        *torchrun,
        str(ROOT / "launch" / "train.py"),
        f"hydra.run.dir={run_dir}",
        "trainer.max_steps=100000",
        "trainer.log_every=5",
        "trainer.checkpoint_every=100000",
        "trainer.eval_every=100000",
        "trainer.progress=false",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "DISTSYNC_TEST_"))}
    proc = subprocess.Popen(
        args,
        cwd=tmp_path,
        env=env | {"OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both ranks are training
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        workers = list(running_descendants(proc.pid))
        assert len(workers) >= 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _wait_gone(workers, 5.0) == []
    finally:
        proc.kill()
        proc.wait()
        _kill_all(workers)
