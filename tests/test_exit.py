"""A user's script that joined with ``distsync.init_distributed()`` ends after training on gloo.

Each test starts the two ranks of a world as plain processes with torchrun's environment
(tests/ddp_exit_script.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launching import job_env
from leftover_processes import alive

import distsync
from distsync import distributed
from distsync.testing import free_port

SCRIPT = Path(__file__).with_name("ddp_exit_script.py")
TIMEOUT_S = 90.0


def run_world(out_dir: Path, endings: list[str], destroy: bool) -> list[subprocess.CompletedProcess]:
    """Run the script on len(endings) ranks; fail the test if any rank is still running after the timeout."""
    port = str(free_port())
    procs = []
    for rank in range(len(endings)):
        env = job_env(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(len(endings)),
        )
        env.pop("PYTHONUNBUFFERED")  # the script's last print must be flushed by the exit itself
        args = [sys.executable, str(SCRIPT), str(out_dir), ",".join(endings), str(int(destroy))]
        pipe = subprocess.PIPE
        procs.append(subprocess.Popen(args, env=env, stdout=pipe, stderr=pipe, text=True))
    results, hung = [], []
    for rank, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            hung.append(rank)
            for other in procs:
                other.kill()
            stdout, stderr = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    if hung:
        pytest.fail(f"rank(s) {hung} still running after {TIMEOUT_S} s:\n{results[hung[0]].stderr[-3000:]}")
    return results


def worker_pids(out_dir: Path, rank: int) -> list[int]:
    return [int(path.read_text()) for path in sorted(out_dir.glob(f"worker.{rank}.*"))]


def check_rank(out_dir: Path, rank: int, result: subprocess.CompletedProcess, code: int) -> None:
    assert result.returncode == code, result.stderr[-3000:]
    # flushed at the exit; before it, gloo of some torch releases (2.8.0) prints "[Gloo] Rank r is connected"
    assert result.stdout.rpartition("\n")[2] == f"rank {rank} trained", result.stdout
    assert "exit handler ran" in (out_dir / f"log.{rank}").read_text()  # handler and logging both ran
    pids = worker_pids(out_dir, rank)
    assert len(pids) == 1 and not alive(pids[0])  # the loader's worker went with the rank


def test_a_ddp_model_outliving_its_group_ends(tmp_path):
    """timm's ending: ``destroy_process_group()``, then the function holding the DDP model returns.

    One run is enough: the script makes the deadlock certain (it hung in 20 runs of 20 before the fix).
    """
    results = run_world(tmp_path, ["exit0", "exit3"], destroy=True)
    check_rank(tmp_path, 0, results[0], 0)
    check_rank(tmp_path, 1, results[1], 3)


def test_a_script_that_never_destroys_its_group_ends_with_its_own_codes(tmp_path):
    results = run_world(tmp_path, ["raise", "exit0"], destroy=False)
    check_rank(tmp_path, 0, results[0], 1)
    assert "RuntimeError: rank 0 fails after training" in results[0].stderr
    check_rank(tmp_path, 1, results[1], 0)


def test_nothing_is_kept_without_a_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kept = list(distributed._kept_groups)
    assert distsync.init_distributed(backend="gloo").type == "cpu"
    assert distributed._kept_groups == kept
