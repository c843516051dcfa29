"""The training worker: the life of one process of a torchrun world, given a resolved :class:`TrainConfig`.

It joins the process group, sizes the CPU threads, locks the run directory, runs the
:class:`~distsync.train.trainer.Trainer`, and tears the group down in an order that cannot deadlock.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import distsync
from distsync.distributed import get_rank, get_world_size, is_distributed
from distsync.launching.lifeline import die_with_parent
from distsync.train.collectives import broadcast_object
from distsync.train.config import TrainConfig
from distsync.train.resume import ResumeError
from distsync.train.rundir import (
    RunDirBusy,
    RunDirLock,
    held_by_launcher,
    keep_hydra_record,
    restore_hydra_record,
)
from distsync.train.trainer import Trainer

__all__ = ["run"]


@record
def run(cfg: TrainConfig, run_dir: str) -> dict:
    """Train under the torchrun environment (or single-process without one) and return the summary.

    Joins the process group with :func:`distsync.init_distributed`, locks ``run_dir`` for this job
    (:class:`~distsync.train.rundir.RunDirBusy` on every rank if another job holds it), resumes from the
    newest checkpoint in ``<run_dir>/checkpoints`` that loads and that the config may continue
    (:mod:`distsync.train.resume`), trains until ``trainer.max_steps``, and on rank 0 writes
    ``metrics.jsonl``, checkpoints, ``summary.json`` and ``curves.png`` under ``run_dir``. Every rank
    returns the same summary (all its values are reduced across ranks). Started by an elastic agent, the
    process dies with the agent (:func:`~distsync.launching.lifeline.die_with_parent`).

    Args:
        cfg: the resolved configuration (a plain dataclass, picklable)
        run_dir: the run directory, the same on every rank
    """
    started = time.time()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    device = distsync.init_distributed(
        cfg.trainer.backend, timeout=datetime.timedelta(seconds=cfg.trainer.timeout_s)
    )
    cores = cpu_threads_per_rank()
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cores)
    lock = None
    try:
        lock = _lock(Path(run_dir))
        try:
            trainer = Trainer(cfg, Path(run_dir), device, started, cores_per_rank=cores)
        except ResumeError:
            if lock is not None:  # Hydra wrote this refused job's record over the one of the job that trained
                restore_hydra_record(run_dir)
            raise
        if lock is not None:
            keep_hydra_record(run_dir)  # this job trains here: its record is the one to keep
        summary = trainer.fit()
    finally:
        if lock is not None:
            lock.release()
    if is_distributed():
        # The group goes after the DDP model that holds it: a gloo group freed by DDP after
        # destroy_process_group can deadlock in its destructor. After a failure it dies with the process.
        gc.collect()
        dist.barrier()  # rank 0 writes the last files after the last collective: nobody tears down before
        dist.destroy_process_group()
    return summary


def cpu_threads_per_rank() -> int:
    """The cores this process may use shared among the ranks running on its host, however many agents
    started them.

    torchrun sets ``OMP_NUM_THREADS=1`` only for several workers per agent, so two agents with one worker
    each on one machine would run twice the threads of one agent with two workers, and sum in another
    order: counting the ranks per host gives every layout the same threads, and the same results. The
    cores are the process's CPU affinity, which a packed sweep (``hydra.launcher.n_jobs``) or a scheduler
    narrows to the job's own.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not is_distributed():
        return cores
    hosts: list[str | None] = [None] * get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return max(1, cores // hosts.count(socket.gethostname()))


def _lock(run_dir: Path) -> RunDirLock | None:
    """Rank 0 locks ``run_dir`` before anything is written there; every rank raises if that failed."""
    lock, error = None, None
    if get_rank() == 0 and not held_by_launcher(run_dir):
        try:
            lock = RunDirLock(run_dir).acquire()
        except RunDirBusy as busy:
            error = str(busy)
            print(f"Error: {error}", file=sys.stderr, flush=True)
            restore_hydra_record(run_dir)  # Hydra wrote this job's record over the holder's
    error = broadcast_object(error)
    if error:
        raise RunDirBusy(error)
    return lock
