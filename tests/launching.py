"""Running the training job's commands as subprocesses, for the end-to-end tests: tiny settings, 1 thread."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from distsync.testing import timeout_scale

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCRIPT = ROOT / "launch" / "train.py"
EXAMPLE_APP = ROOT / "examples" / "hydra_app"
RUN_OUTPUTS = ("outputs", "multirun", "__pycache__")
"""What running an app leaves in its folder: Hydra's run and sweep directories (an Optuna sweep's journal
among them) and Python's byte code. A user who followed the example's README inside the checkout has them."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(SCRIPT)]
FAST = [
    "trainer.log_every=5",
    "trainer.eval_every=10",
    "trainer.checkpoint_every=10",
    "trainer.monitor_interval=0.2",
]


def copy_example_app(dest: Path, source: Path = EXAMPLE_APP) -> Path:
    """The example app copied to ``dest`` (outside the checkout: it runs against the installed distsync),
    without the outputs of earlier runs in ``source``, which would mix with the tests' own."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(*RUN_OUTPUTS))
    return dest


def job_env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's, the test hooks' or HYDRA_FULL_ERROR, plus ``extra``; the tests'
    folder comes first on the ``PYTHONPATH`` (``extra``'s or this one's), so that every process of a job
    imports the tests' own modules (``paced_data``, ``bn_subclasses``, ...) as the tests do."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "DISTSYNC_TEST_"))}
    env.pop("HYDRA_FULL_ERROR", None)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


def run_job(args: list, cwd: Path, timeout: float = 150, **env: str) -> subprocess.CompletedProcess:
    """Run a command to its end; print its output's tail if it failed (pytest shows it then).

    ``timeout`` is an idle machine's, times :func:`distsync.testing.timeout_scale`. The command runs in a
    session of its own: on a timeout its whole process group is killed, so no worker it started is left
    holding the output pipes (which would block this call after the timeout)."""
    timeout *= timeout_scale()
    with subprocess.Popen(
        args, cwd=cwd, env=job_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as popen:  # fmt: skip
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            print(stdout[-4000:], stderr[-4000:], sep="\n---\n")
            raise subprocess.TimeoutExpired(args, timeout, stdout, stderr) from None
    proc = subprocess.CompletedProcess(args, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n---\n")
    return proc


def unexpected_keyword(function: str, keyword: str, meant: str) -> str:
    """Python's ``TypeError`` message for a misspelled keyword argument; from 3.13 it names the one meant."""
    message = f"{function}() got an unexpected keyword argument '{keyword}'"
    return message + (f". Did you mean '{meant}'?" if sys.version_info >= (3, 13) else "")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metric_steps(run_dir: Path, kind: str) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["kind"] == kind]
