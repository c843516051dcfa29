"""Part 7: the packaged training job on the device, as a user starts it.

``python launch/train.py trainer.nproc_per_node=1`` (a one-rank world: NCCL on a GPU) for a few hundred
steps, then the same job as a one-job sweep through the Hydra plugin (``-m hydra/launcher=torchrun``).
Each must exit 0 and write a summary saying where it ran (device, backend) with BN buffers in sync.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, Findings, limit_scale, quick

LOGGING = ["trainer.log_every=50", "trainer.eval_every=100", "trainer.checkpoint_every=100"]


def _run(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    return proc, time.perf_counter() - started


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout[-600:] + "\n" + proc.stderr[-1500:]).strip()


def _summary_checks(findings: Findings, label: str, run_dir: Path, device: str, steps: int) -> None:
    path = run_dir / "summary.json"
    if not findings.check(f"{label}: summary.json written", path.exists(), str(path)):
        return
    summary = json.loads(path.read_text())
    backend = "nccl" if device == "cuda" else "gloo"
    where = (summary["device"], summary["backend"], summary["world_size"], summary["steps"])
    findings.check(
        f"{label}: {steps} steps on 1 {device} rank over {backend}",
        where == (device, backend, 1, steps),
        f"device, backend, world_size, steps = {where}",
    )
    findings.check(f"{label}: BN buffers in sync", summary["bn_buffers_in_sync"] is True)
    findings.figure(f"{label}: held-out accuracy", summary["accuracy"])
    findings.figure(f"{label}: wall seconds in the job", summary["wall_seconds"])


def run(findings: Findings, device: str) -> None:
    steps, sweep_steps = (30, 20) if quick(device) else (300, 100)
    with tempfile.TemporaryDirectory(prefix="distsync-gpu-job-") as scratch:
        run_dir = Path(scratch) / "run"
        args = [
            "trainer.nproc_per_node=1",
            f"trainer.max_steps={steps}",
            f"hydra.run.dir={run_dir}",
            *LOGGING,
        ]
        proc, seconds = _run(args, timeout=150 * limit_scale(device))
        findings.figure("launch/train.py: seconds, command start to exit", round(seconds, 1))
        findings.check(
            "launch/train.py trainer.nproc_per_node=1: exit 0",
            proc.returncode == 0,
            _tail(proc) if proc.returncode else "",
        )
        _summary_checks(findings, "launch/train.py", run_dir, device, steps)

        sweep = Path(scratch) / "sweep"
        args = [
            "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=1", f"hydra.sweep.dir={sweep}",
            "optim.lr=0.05", f"trainer.max_steps={sweep_steps}", *LOGGING,
        ]  # fmt: skip
        proc, seconds = _run(args, timeout=150 * limit_scale(device))
        findings.figure("plugin sweep of one job: seconds, command start to exit", round(seconds, 1))
        findings.check(
            "-m hydra/launcher=torchrun, one job: exit 0",
            proc.returncode == 0,
            _tail(proc) if proc.returncode else "",
        )
        _summary_checks(findings, "plugin job", sweep / "0", device, sweep_steps)
        findings.check("plugin sweep: sweep_summary.md written", (sweep / "sweep_summary.md").exists())
