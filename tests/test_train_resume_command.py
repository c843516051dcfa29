"""The command a run prints to resume it (distsync/train/resume_command.py): runnable where printed."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from launching import FAST, run_job, summary

from distsync.train.resume_command import COMMAND_ENV, resume_command
from distsync.train.rundir import slurm_step


def recorded(argv: list[str], args: list[str], pid: int = 1, slurm_job: str | None = None) -> dict[str, str]:
    return {COMMAND_ENV: json.dumps({"pid": pid, "argv": argv, "args": args, "slurm_job": slurm_job})}


def test_a_module_run_keeps_its_module():
    """``python -m distsync.train ...``: the module stays in the command (not ``python -m key=value``)."""
    env = recorded(
        [sys.executable, "-u", "-m", "distsync.train", "a=1", "hydra.run.dir=old"],
        ["a=1", "hydra.run.dir=old"],
    )
    assert (
        resume_command("/runs/x", environ=env)
        == f"{sys.executable} -u -m distsync.train a=1 hydra.run.dir=/runs/x"
    )


def test_a_sweep_job_resumes_the_whole_sweep_of_the_command_that_submitted_it():
    """In a job process of Hydra's submitit launcher (whose own command line is submitit's), the command
    is the one that started the sweep, with its sweep directory pinned."""
    argv = [sys.executable, "launch/train.py", "-m", "hydra/launcher=submitit_slurm", "optim.lr=0.1,0.2"]
    env = {**recorded(argv, argv[2:]), "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}  # submitted from outside
    assert resume_command("/s/0", sweep_dir="/s", environ=env) == shlex.join([*argv, "hydra.sweep.dir=/s"])


def test_inside_a_slurm_step_the_command_is_an_srun_of_the_steps_shape():
    argv = [sys.executable, "-m", "distsync.train", "trainer.nnodes=2"]
    slurm = {
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_CPUS_PER_TASK": "4",
        "SLURM_GPUS_PER_NODE": "8",
        "SLURM_JOB_PARTITION": "gpu",
    }
    env = {**recorded(argv, argv[3:], slurm_job="42"), **slurm}  # recorded in this step
    assert resume_command("/r", environ=env) == (
        "srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=4 --gpus-per-node=8 --partition=gpu "
        f"{sys.executable} -m distsync.train trainer.nnodes=2 hydra.run.dir=/r"
    )


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}, "42.0"),
        ({"SLURM_JOB_ID": "42", "ENVIRONMENT": "BATCH"}, "42.batch"),
        (
            {
                "SLURM_JOB_ID": "43",
                "SLURM_STEP_ID": "1",
                "SLURM_ARRAY_JOB_ID": "40",
                "SLURM_ARRAY_TASK_ID": "3",
            },
            "40_3.1",
        ),
        ({"SLURM_JOB_ID": "42"}, None),  # an salloc shell: every run its own timestamped directory
        ({}, None),
    ],
)
def test_the_run_directory_of_a_slurm_step(environ, expected):
    assert slurm_step(environ) == expected


@pytest.mark.slow
def test_external_torchrun_of_the_module_prints_a_resume_command_that_resumes(tmp_path):
    """``torchrun -m distsync.train``: rank 0 prints torchrun's own command line with the run directory
    pinned, once; run as printed, it continues the run."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "distsync.train"]
    proc = run_job([*torchrun, "trainer.max_steps=10", *FAST], tmp_path)
    assert proc.returncode == 0
    lines = [line for line in proc.stderr.splitlines() if "after an interruption, resume it with: " in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    command = shlex.split(lines[0].split("resume it with: ", 1)[1])
    assert command[: len(torchrun)] == torchrun and command[-1].startswith("hydra.run.dir=")
    run_dir = command[-1].removeprefix("hydra.run.dir=")
    assert summary(tmp_path / run_dir)["steps"] == 10
    again = run_job(command, tmp_path)
    assert again.returncode == 0
    assert f"resumed from {run_dir}/checkpoints/step_00000010.pt" in again.stdout  # the same run, found again
    assert "finished at step 10 already" in again.stdout
