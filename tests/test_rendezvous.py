"""A rendezvous of its own per job (distsync/launching/rendezvous.py): the store says whose it is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from launching import FAST, SCRIPT, job_env, run_job
from torch.distributed import TCPStore

from distsync.launching.rendezvous import OWNER_KEY, slurm_port
from distsync.testing import free_port, timeout_scale


def test_slurm_jobs_meet_on_ports_of_their_own():
    assert slurm_port("41") != slurm_port("42")
    assert slurm_port(42) == slurm_port("42") == 20042  # a requeued job keeps its id, and its port
    assert all(20000 <= slurm_port(job) < 30000 for job in (0, 9999, 10000, 123456789))


def owner(port: int) -> str | None:
    try:
        store = TCPStore("localhost", port, is_master=False, timeout=timedelta(seconds=1))
        return store.get(OWNER_KEY).decode() if store.check([OWNER_KEY]) else None
    except (RuntimeError, TimeoutError):
        return None


@pytest.mark.slow
def test_an_agent_of_another_run_is_refused_in_one_line(tmp_path):
    """Two runs given the same endpoint: the second one's agent does not join the first one's store (where
    it would wait for nodes of its own, and die with the first run), it fails at once naming both runs."""
    port = free_port()
    node = [sys.executable, str(SCRIPT), "trainer.nnodes=2", "trainer.nproc_per_node=1", *FAST]
    node.append(f"trainer.rdzv_endpoint=localhost:{port}")
    first = subprocess.Popen(
        [*node, "trainer.rdzv_id=run-a", f"hydra.run.dir={tmp_path / 'a'}"],
        cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90 * timeout_scale()
        while owner(port) != "run-a":  # the first run's agent serves the store, waiting for its 2nd node
            assert first.poll() is None and time.monotonic() < deadline, "the first agent did not start"
            time.sleep(0.2)
        proc = run_job(
            [*node, "trainer.rdzv_id=run-b", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path, timeout=90
        )
        assert first.poll() is None  # the first run waits on, untouched
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert proc.returncode == 1
    assert (
        f"Error: training failed: the rendezvous store at localhost:{port} belongs to run 'run-a', "
        "not to this job's run 'run-b'"
    ) in proc.stderr
    assert "Traceback" not in proc.stderr
