"""One job per run directory: an exclusive ``flock`` on ``<run_dir>/.lock`` for the life of the job.

Rank 0 takes it before anything is written, or a launching process does for its workers
(``RunDirLock(run_dir, for_workers=True)``, which :func:`held_by_launcher` tells rank 0). The kernel drops
it when the holder exits, however it exits. See docs/training.md, "Re-running into a run directory".
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import shutil
import socket
from pathlib import Path

__all__ = [
    "RunDirBusy",
    "RunDirLock",
    "RunDirUnlockable",
    "held_by_launcher",
    "keep_hydra_record",
    "restore_hydra_record",
    "slurm_step",
]

LOCK_NAME = ".lock"
RECORD_NAME = ".hydra.trained"
"""A copy of Hydra's ``.hydra/`` record of the job that trains (or last trained) in the run directory."""
HELD_ENV = "DISTSYNC_RUN_DIR_LOCKED"
"""Set by a launching process that holds the lock of this (resolved) run directory for its workers."""


def held_by_launcher(run_dir: str | os.PathLike) -> bool:
    """True if the process that started this one holds ``run_dir``'s lock for it."""
    return os.environ.get(HELD_ENV) == str(Path(run_dir).resolve())


class RunDirBusy(RuntimeError):
    """Another live job holds the run directory's lock."""


class RunDirUnlockable(RunDirBusy):
    """The run directory's filesystem cannot lock files (Lustre without ``-o flock``, some NFS setups)."""


_NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory, held until :meth:`release` or process exit.

    Args:
        run_dir: the directory; created if missing
        for_workers: also set :data:`HELD_ENV` while held, so that the workers this process starts
            (which inherit the environment) know the lock is held for them. Default: False

    Example::

        >>> with RunDirLock("outputs/run"):  # raises RunDirBusy if another job holds it
        ...     train()
    """

    def __init__(self, run_dir: str | os.PathLike, for_workers: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.for_workers = for_workers
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock, or raise :class:`RunDirBusy` naming the job that holds it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in _NO_LOCKS:
                raise RunDirUnlockable(
                    f"run directory {self.run_dir} is on a filesystem without file locks (flock: "
                    f"{error.strerror}); put runs on a filesystem with locks (hydra.run.dir=..., "
                    "hydra.sweep.dir=...), or mount it with them (Lustre: -o flock)"
                ) from None
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = self._holder() or "another job"
            raise RunDirBusy(
                f"run directory {self.run_dir} is in use by {holder}; wait for that job to finish or "
                "use another run directory (hydra.run.dir=...)"
            ) from None
        started = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {started}\n".encode())
        self._fd = fd
        if self.for_workers:
            os.environ[HELD_ENV] = str(self.run_dir.resolve())
        return self

    def release(self) -> None:
        """Drop the lock (the file stays; it is only a lock target)."""
        if self._fd is not None:
            if self.for_workers and held_by_launcher(self.run_dir):
                del os.environ[HELD_ENV]
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _holder(self) -> str:
        try:
            return self.path.read_text().strip()
        except OSError:
            return ""

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def slurm_step(environ: os._Environ | dict[str, str] | None = None) -> str | None:
    """``<job id>.<step id>`` of the SLURM job step this process runs in (``<job id>.batch`` in a batch
    script itself; an array task's job id is ``<array job id>_<task id>``), as ``sacct`` names steps; None
    outside a batch job or ``srun`` step (an ``salloc`` shell). The same on every node of the step, and again
    when the job is requeued: a run directory named after it is found again by the requeued job."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    step = environ.get("SLURM_STEP_ID") or ("batch" if environ.get("ENVIRONMENT") == "BATCH" else None)
    if not job or not step:
        return None
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return f"{job}.{step}"


def keep_hydra_record(run_dir: str | os.PathLike) -> None:
    """Copy Hydra's record of this job (``.hydra/*.yaml``) aside, once it is sure to train here."""
    source, kept = Path(run_dir) / ".hydra", Path(run_dir) / RECORD_NAME
    if source.is_dir():
        kept.mkdir(exist_ok=True)
        for path in source.glob("*.yaml"):
            shutil.copy2(path, kept / path.name)


def restore_hydra_record(run_dir: str | os.PathLike) -> None:
    """Put back the record of the job that trained here: Hydra wrote a refused job's over it."""
    kept, target = Path(run_dir) / RECORD_NAME, Path(run_dir) / ".hydra"
    if kept.is_dir() and target.is_dir():
        for path in kept.glob("*.yaml"):
            shutil.copy2(path, target / path.name)
