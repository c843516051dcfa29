"""The multi-node path on one machine: two launch/train.py agents meet at one c10d rendezvous, one world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from launching import FAST, SCRIPT, job_env

from distsync.testing import free_port


def _run_nodes(
    args: list[str], cwd: Path, nodes: int, timeout: float, env: dict[str, str] | None = None
) -> list[tuple[int | None, str, str]]:
    """Run ``nodes`` copies of the command at once; (returncode, stdout, stderr) of each, in order.

    Output goes to files, so that no node blocks on a full pipe while the test waits for another one. If the
    deadline passes, every node still running is killed (a lone agent would wait for its peers).
    """
    procs, files = [], []
    for node in range(nodes):
        out, err = cwd / f"node{node}.out", cwd / f"node{node}.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            procs.append(subprocess.Popen(args, cwd=cwd, env=env or job_env(), stdout=stdout, stderr=stderr))
        files.append((out, err))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        codes = [proc.poll() for proc in procs]  # None: still running at the deadline
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # its workers die with it (the lifeline)
                proc.wait()
    results = [
        (code, out.read_text(), err.read_text()) for code, (out, err) in zip(codes, files, strict=True)
    ]
    if any(code != 0 for code, _, _ in results):
        for node, (code, stdout, stderr) in enumerate(results):
            print(f"=== node {node}: exit {code}", stdout[-3000:], stderr[-3000:], sep="\n---\n")
    return results


@pytest.mark.slow
def test_two_agents_on_one_machine_form_one_world(tmp_path):
    run_dir = tmp_path / "run"  # the same directory for both nodes, as on a shared filesystem
    args = [
        sys.executable,
        str(SCRIPT),
        "trainer.nnodes=2",
        "trainer.nproc_per_node=1",
        f"trainer.rdzv_endpoint=localhost:{free_port()}",
        f"trainer.rdzv_id=test-{uuid.uuid4().hex[:12]}",
        f"hydra.run.dir={run_dir}",
        "trainer.max_steps=20",
        *FAST,
    ]
    env = job_env()
    del env["OMP_NUM_THREADS"]  # the job decides the threads
    results = _run_nodes(args, tmp_path, nodes=2, timeout=240, env=env)
    busy = [stderr for _, _, stderr in results if "is in use" in stderr]
    assert not busy, f"the nodes of one job must share the run directory: {busy[0][-500:]}"
    assert [code for code, _, _ in results] == [0, 0]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 20
    assert s["bn_buffers_in_sync"] is True
    assert s["restarts"] == 0
    assert all("waiting for 2 node(s) at localhost:" in stderr for _, _, stderr in results)
    assert s["cpu_threads"] == max(1, (os.cpu_count() or 1) // 2)  # 2 ranks on this machine, 2 agents
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [5, 10, 15, 20]  # written once, by rank 0
    assert sum(stdout.count("step=20 ") for _, stdout, _ in results) == 1  # only rank 0 talks to the console
