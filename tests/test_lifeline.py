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
from launching import job_env
from leftover_processes import alive, command, running_descendants, running_in_group

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
        # 15 s: once, under a load of 6.5 on 2 cores, one of them outlived 5 s (16 s scaled); the message
        # names what is left, and one that never dies still fails
        left = _wait_gone(workers, 15.0)
        assert left == [], {pid: command(pid) for pid in left}
    finally:
        proc.kill()
        proc.wait()
        _kill_all(workers)


def _pids(out_dir: Path, pattern: str) -> list[int]:
    return [int(path.read_text()) for path in sorted(out_dir.glob(pattern)) if not path.name.endswith(".tmp")]


@pytest.mark.parametrize("killed", ["rank", "launcher"])
def test_nothing_of_a_job_outlives_a_sigkill(tmp_path, killed):
    """A rank SIGKILLed (the OOM killer) or the launcher SIGKILLed: within 20 s no process of the job runs,
    the ranks' DataLoader workers and fork servers included. Under the default ``forkserver`` start method
    a rank's persistent loader workers are forked by a fork server of the rank's own, not by the rank:
    torch's watchdog in them watches that server, which their lifeline pipes keep running (before: both
    were still there minutes later). The other rank, whose peer is gone, ends too."""
    tests = Path(__file__).parent
    code = f"import elastic_fns; elastic_fns.launch_and_print('train_on_loader_workers', {str(tmp_path)!r})"
    with (tmp_path / "output").open("w") as output:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=tests,
            env=job_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its process group: the launcher's, which every process of the job joins
        )
    try:
        deadline = time.monotonic() + 120 * timeout_scale()
        while len(_pids(tmp_path, "rank.*")) < 2 or len(_pids(tmp_path, "worker.*")) < 4:
            output = (tmp_path / "output").read_text()[-3000:]
            assert proc.poll() is None and time.monotonic() < deadline, output
            time.sleep(0.1)
        ranks, loader_workers = _pids(tmp_path, "rank.*"), _pids(tmp_path, "worker.*")
        forked_by = {pid: parent for rank in ranks for pid, parent in running_descendants(rank).items()}
        assert set(loader_workers) <= set(forked_by)
        assert all(forked_by[pid] not in ranks for pid in loader_workers)  # a fork server forked them
        job = running_in_group(proc.pid)
        assert set(ranks) | set(loader_workers) | set(forked_by.values()) <= set(job)
        os.kill(ranks[1] if killed == "rank" else proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20 * timeout_scale()
        while running_in_group(proc.pid) and time.monotonic() < deadline:
            proc.poll()  # the launcher, once it has exited (a rank killed), is no zombie of this process
            time.sleep(0.1)
        left = {pid: command(pid) for pid in running_in_group(proc.pid)}
        assert not left, f"still running 20 s after the {killed} was SIGKILLed: {left}"
    finally:
        _kill_all(running_in_group(proc.pid))
        proc.kill()
        proc.wait()
