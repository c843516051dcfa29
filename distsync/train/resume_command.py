"""The command that resumes a run, as the job prints it at its start and when it is stopped.

The command the user started, with ``hydra.run.dir`` (a sweep: ``hydra.sweep.dir``) pinned, whichever
process prints it: :func:`record_command`, called by every entry point before Hydra starts, leaves it in
the environment of the processes it starts (submitit's jobs, packed sweep jobs); under an external
torchrun it is the agent's command line; inside SLURM it is wrapped in ``srun`` with the job's shape.
No Hydra here: the launcher passes what it needs of Hydra's config.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["COMMAND_ENV", "record_command", "resume_command"]

COMMAND_ENV = "DISTSYNC_TRAIN_COMMAND"
"""Set by :func:`record_command`: the process's pid, command line, the Hydra arguments in it and SLURM job."""


def record_command(environ: os._Environ | dict[str, str] | None = None) -> None:
    """Leave this process's command in the environment, for the processes it starts (``sys.argv`` before
    anything is appended to it)."""
    environ = os.environ if environ is None else environ
    environ[COMMAND_ENV] = json.dumps(
        {
            "pid": os.getpid(),
            "argv": list(getattr(sys, "orig_argv", sys.argv)),
            "args": sys.argv[1:],
            "slurm_job": environ.get("SLURM_JOB_ID"),
        }
    )


def resume_command(
    run_dir: str,
    *,
    sweep_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The shell command that resumes this job in ``run_dir`` (a single run) or its whole sweep in
    ``sweep_dir`` (a job of a ``-m`` sweep)."""
    environ = os.environ if environ is None else environ
    argv, args, slurm_job = _started_by(environ)
    program = argv[: len(argv) - len(args)] if args and list(argv[-len(args) :]) == list(args) else argv
    pinned = ("hydra.sweep.dir", sweep_dir) if sweep_dir is not None else ("hydra.run.dir", run_dir)
    kept = [arg for arg in args if not arg.startswith(f"{pinned[0]}=")]
    command = [*_readable(program), *kept, "=".join(pinned)]
    if slurm_job is not None and slurm_job == environ.get("SLURM_JOB_ID"):
        command = [*_srun(environ), *command]
    return shlex.join(command)


def _started_by(environ: Mapping[str, str]) -> tuple[list[str], list[str], str | None]:
    """``(command line, the Hydra arguments at its end, SLURM job it ran in)`` of what the user started."""
    recorded = json.loads(environ.get(COMMAND_ENV) or "null")
    if recorded and recorded["pid"] != os.getpid():  # started by the recording process, or by its child
        return recorded["argv"], recorded["args"], recorded["slurm_job"]
    args = recorded["args"] if recorded else sys.argv[1:]
    if "TORCHELASTIC_RUN_ID" in environ:  # a worker of an external torchrun: its agent's command line
        agent = _command_line(os.getppid())
        if agent and (not args or agent[-len(args) :] == args):
            return agent, args, environ.get("SLURM_JOB_ID")
    return list(getattr(sys, "orig_argv", sys.argv)), args, environ.get("SLURM_JOB_ID")


def _command_line(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="surrogateescape") for part in raw.split(b"\0")[:-1]]


def _readable(program: Sequence[str]) -> list[str]:
    """``python /venv/bin/torchrun`` as ``torchrun``: a console script beside the interpreter, run by it."""
    program = list(program)
    beside = len(program) >= 2 and Path(program[1]).parent == Path(program[0]).parent
    if beside and Path(program[1]).is_file():
        return [Path(program[1]).name, *program[2:]]
    return program


def _srun(environ: Mapping[str, str]) -> list[str]:
    """``srun`` with the shape of this step: its nodes, one task per node, the job's CPUs, GPUs, partition."""
    nodes = environ.get("SLURM_STEP_NUM_NODES") if "SLURM_STEP_ID" in environ else None
    options = [f"--nodes={nodes or 1}", "--ntasks-per-node=1"]
    for variable, option in (
        ("SLURM_CPUS_PER_TASK", "--cpus-per-task"),
        ("SLURM_GPUS_PER_NODE", "--gpus-per-node"),
        ("SLURM_JOB_PARTITION", "--partition"),
    ):
        if environ.get(variable):
            options.append(f"{option}={environ[variable]}")
    return ["srun", *options]
