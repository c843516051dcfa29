"""A small gloo world for benchmarks, and lockstep timing of interleaved variants across its ranks."""

from __future__ import annotations

import os
import socket
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Budget:
    """How long to measure: ``reps`` interleaved repetitions of ``inner`` calls, after ``warmup`` calls."""

    reps: int
    inner: int
    warmup: int = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    # benchmarks time bare layers and models on purpose, some without DDP
    warnings.filterwarnings("ignore", "distsync: the synchronized layer", RuntimeWarning)
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        if rank == 0:
            queue.put(result)
        dist.barrier()  # no rank tears its group down while another still uses it (gloo aborts then)
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable, *args, world_size: int = 2):
    """Run ``fn(*args)`` on ``world_size`` spawned gloo ranks (one thread each); return rank 0's result."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks before they import torch
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world_size, _free_port(), fn, args, queue), nprocs=world_size, join=True)
    return queue.get()


def device() -> torch.device:
    """This rank's device: its CUDA device when there is one (ranks may share it), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_interleaved(
    variants: dict[str, Callable[[], None]], budget: Budget, clock: Callable[[], float] = time.perf_counter
) -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per repetition, the slowest rank's time.

    Every repetition runs each variant once as a block of ``budget.inner`` calls, the order rotating from
    one repetition to the next so no variant always follows the same one. Every block starts on a barrier
    (all ranks in lockstep) and its time is the maximum over the ranks. ``clock`` reads the time: wall
    time by default; a benchmark of host cost passes a CPU-time clock of its own.
    """
    names = list(variants)
    for name in names:
        for _ in range(budget.warmup):
            variants[name]()
    times = torch.zeros(len(names), budget.reps, dtype=torch.float64)
    for rep in range(budget.reps):
        shift = rep % len(names)
        for index in list(range(shift, len(names))) + list(range(shift)):
            fn = variants[names[index]]
            sync_device()
            dist.barrier()
            start = clock()
            for _ in range(budget.inner):
                fn()
            sync_device()
            times[index, rep] = (clock() - start) / budget.inner
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: times[i].tolist() for i, name in enumerate(names)}


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio_quartiles(numerator: list[float], denominator: list[float]) -> list[float]:
    """25th, 50th and 75th percentiles of the per-repetition ratios."""
    return statistics.quantiles((a / b for a, b in zip(numerator, denominator, strict=True)), n=4)


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over repetitions of the ratio of two variants timed side by side in that repetition."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))
