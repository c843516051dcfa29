"""A rendezvous of its own per job (distsync/launching/rendezvous.py): the store says whose it is; under SLURM
(distsync/launching/slurm_rendezvous.py, SLURM's variables set by hand here) the job's agents meet on the
first of its ports that no program and no other run holds, and agree on it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from launching import FAST, SCRIPT, job_env, run_job
from torch.distributed import TCPStore

from distsync.launching.rendezvous import OWNER_KEY, RendezvousError
from distsync.launching.slurm_rendezvous import (
    SLURM_PORTS,
    SlurmRendezvous,
    claimed_slurm_store,
    slurm_port,
    slurm_ports,
    slurm_rendezvous,
)
from distsync.testing import free_port, timeout_scale


def test_slurm_jobs_meet_on_ports_of_their_own():
    assert slurm_port("41") != slurm_port("42")
    assert slurm_port(42) == slurm_port("42") == 20042  # a requeued job keeps its id, and its port
    assert all(20000 <= slurm_port(job) < 30000 for job in (0, 9999, 10000, 123456789))


def test_jobs_whose_first_ports_collide_go_on_with_ports_of_their_own():
    """Job ids equal modulo the range share their first port (the issue's 4321 and 14321), not the next."""
    first, second = slurm_ports(4321), slurm_ports("14321")
    assert first[0] == second[0] == slurm_port(4321) == 24321
    assert not set(first[1:]) & set(second[1:])
    assert slurm_ports(4321) == first  # the same on every node, and for the job requeued
    for ports in (first, second, slurm_ports(0), slurm_ports(123456789)):
        assert len(set(ports)) == len(ports) == 16 and all(port in SLURM_PORTS for port in ports)


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


# ------------------------------------------------------------------------ SLURM: the walk over a job's ports


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct ports free a moment ago (held together while picked, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return tuple(sock.getsockname()[1] for sock in socks)


@contextlib.contextmanager
def silent_program(port: int):
    """Another program on ``port``: it listens, the kernel accepts connections for it, it never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen(16)
        yield


@contextlib.contextmanager
def store_of_another_run(port: int, run_id: str):
    """A distsync rendezvous store of ``run_id`` at ``port``, served by another process."""
    serve = (
        "import sys, time; from datetime import timedelta; from torch.distributed import TCPStore\n"
        f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
        f"s.set({OWNER_KEY!r}, {run_id!r}); print('up', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "up\n"
        yield
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def walk(ports, run_id: str, serves: bool, timeout_s: float = 60) -> tuple[str, bool, float]:
    """``claimed_slurm_store`` of one agent: the endpoint it found, whether it serves, seconds it took."""
    started = time.monotonic()
    with claimed_slurm_store(SlurmRendezvous("127.0.0.1", ports, serves), run_id, timeout_s) as found:
        return (*found, time.monotonic() - started)


def test_a_port_another_program_holds_is_passed_over_by_every_agent():
    """The issue's second case: a program holds the job's first port (it accepts, never answers). The
    serving agent takes the next port, the other agent finds it there; neither waits out the timeout."""
    ports = free_ports(4)
    with silent_program(ports[0]):
        with claimed_slurm_store(SlurmRendezvous("127.0.0.1", ports, True), "job-7", 60) as served:
            assert served == (f"127.0.0.1:{ports[1]}", True)
            assert owner(ports[1]) == "job-7"
            endpoint, serving, took = walk(ports, "job-7", serves=False)
    assert (endpoint, serving) == (f"127.0.0.1:{ports[1]}", False)
    assert took < 15 * timeout_scale()  # one handshake's wait on the silent port, not the rendezvous timeout


def test_a_store_of_another_run_is_passed_over_and_never_joined():
    """The issue's first case: another job's store holds this job's first port (job ids equal modulo the
    range). This job's agents meet at its next port, and the other run's store is left as it was."""
    ports = free_ports(3)
    with store_of_another_run(ports[0], "4321"):
        with claimed_slurm_store(SlurmRendezvous("127.0.0.1", ports, True), "14321", 60) as served:
            assert served == (f"127.0.0.1:{ports[1]}", True)
            assert walk(ports, "14321", serves=False)[:2] == (f"127.0.0.1:{ports[1]}", False)
        assert owner(ports[0]) == "4321"


def test_an_agent_that_looks_before_its_server_has_bound_finds_it_on_a_later_walk():
    """An agent that walks the ports before the serving agent starts (the nodes of a job start in any
    order) finds nothing at first, skips no port for good, and meets the server where it binds."""
    ports = free_ports(3)
    found = []
    looking = threading.Thread(target=lambda: found.append(walk(ports, "job-8", serves=False)))
    looking.start()
    try:
        time.sleep(2.0)  # several walks over all three ports, none answering
        with silent_program(ports[0]):  # and the server's first port is taken meanwhile
            with claimed_slurm_store(SlurmRendezvous("127.0.0.1", ports, True), "job-8", 60) as served:
                looking.join(30 * timeout_scale())
    finally:
        looking.join()
    assert served == (f"127.0.0.1:{ports[1]}", True)
    assert found[0][:2] == (f"127.0.0.1:{ports[1]}", False)


def test_no_store_or_no_free_port_is_one_line_naming_the_ports():
    ports = free_ports(2)
    nothing = r"no rendezvous store of run 'job-9' on 127\.0\.0\.1 within 1 s"
    with pytest.raises(RendezvousError, match=nothing):
        walk(ports, "job-9", serves=False, timeout_s=1)
    with silent_program(ports[0]), store_of_another_run(ports[1], "other"):
        with pytest.raises(RendezvousError, match="hold all 2 of its ports") as refused:
            walk(ports, "job-9", serves=True)
    assert str(ports[0]) in str(refused.value) and "rdzv_endpoint" in str(refused.value)


def fake_scontrol(tmp_path, monkeypatch, script: str) -> None:
    (tmp_path / "scontrol").write_text(f"#!/bin/sh\n{script}\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_the_endpoint_from_slurms_variables(tmp_path, monkeypatch):
    """The first node of the allocation, the job's ports; the first task on it serves the store."""
    fake_scontrol(tmp_path, monkeypatch, "echo localhost; echo n2")
    env = {"SLURM_JOB_ID": "4321", "SLURM_JOB_NODELIST": "localhost,n2", "SLURM_PROCID": "0"}
    assert slurm_rendezvous(env) == SlurmRendezvous("localhost", slurm_ports(4321), serves=True)
    assert not slurm_rendezvous({**env, "SLURM_PROCID": "1"}).serves  # another task on the first node
    assert slurm_rendezvous({**env, "SLURM_JOB_NODELIST": "localhost"}).host == "localhost"  # no scontrol


def test_no_node_list_or_a_failing_scontrol_is_one_line_saying_what_to_pass(tmp_path, monkeypatch):
    with pytest.raises(RendezvousError) as missing:
        slurm_rendezvous({"SLURM_JOB_ID": "4321"})
    assert str(missing.value) == (
        "SLURM_JOB_ID is set (4321) but SLURM_JOB_NODELIST is not, so the job's first node is unknown here: "
        "pass rdzv_endpoint=host:port (the same on every node)"
    )
    fake_scontrol(tmp_path, monkeypatch, 'echo "scontrol: error: Invalid node name specified" >&2; exit 1')
    with pytest.raises(RendezvousError) as failed:
        slurm_rendezvous({"SLURM_JOB_ID": "4321", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert str(failed.value) == (
        "cannot find the job's first node: `scontrol show hostnames n[1-2]` failed (scontrol: error: Invalid "
        "node name specified); pass rdzv_endpoint=host:port (the same on every node)"
    )
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no scontrol at all (a container)
    with pytest.raises(RendezvousError, match=r"`scontrol show hostnames n\[1-2\]` failed \(.*scontrol"):
        slurm_rendezvous({"SLURM_JOB_ID": "4321", "SLURM_JOB_NODELIST": "n[1-2]"})


@pytest.mark.slow
def test_a_slurm_job_id_without_a_node_list_runs_at_the_endpoint_given(tmp_path):
    """The issue's third case, through the packaged job: SLURM_JOB_ID without SLURM_JOB_NODELIST (a
    container, an ssh into the allocation's node). With rdzv_endpoint given it trains (the run id is the
    job's); without one, it fails in one line that names the variable and what to pass."""
    node = [sys.executable, str(SCRIPT), "trainer.nproc_per_node=1", "trainer.max_steps=10", *FAST]
    given = [*node, "trainer.nnodes=1", f"trainer.rdzv_endpoint=localhost:{free_port()}"]
    proc = run_job([*given, f"hydra.run.dir={tmp_path / 'given'}"], tmp_path, SLURM_JOB_ID="4321")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "given" / "summary.json").exists()
    proc = run_job(
        [*node, "trainer.nnodes=2", f"hydra.run.dir={tmp_path / 'none'}"], tmp_path, SLURM_JOB_ID="4321"
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: training failed: SLURM_JOB_ID is set (4321) but SLURM_JOB_NODELIST is not, so the job's "
        "first node is unknown here: pass rdzv_endpoint=host:port (the same on every node)"
    )
    assert "Traceback" not in proc.stderr
