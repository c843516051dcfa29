"""Which devices a torchrun world runs on: :class:`DeviceSet`, and how a machine is split among worlds.

Several worlds on one machine (the jobs of a packed sweep, or a script's own worlds) must not share GPUs or
cores. :func:`visible_devices` says what this process may use (GPUs if any, else CPU cores; inside a SLURM
allocation only the allocation's), :func:`split_devices` cuts that into disjoint sets, one per running world
(a pure function), and :func:`pin_process` applies a set in a worker before anything else runs there:
``CUDA_VISIBLE_DEVICES`` for GPUs, the CPU affinity (and torch's thread count) for cores. Where a launch
gives its ranks fewer cores than they need, :func:`warn_if_crowded` says so once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DeviceSet",
    "crowding",
    "pin_process",
    "split_devices",
    "usable_cores",
    "visible_devices",
    "warn_if_crowded",
]

FAKE_GPUS_ENV = "DISTSYNC_TEST_GPUS"
"""Test hook: stands for ``torch.cuda.device_count()`` in :func:`visible_devices` (no GPU needed)."""


@dataclass(frozen=True)
class DeviceSet:
    """The devices of one torchrun world: GPUs or CPU cores.

    Args:
        kind: ``"cuda"`` (GPUs: the workers see ``CUDA_VISIBLE_DEVICES`` set to ``ids``, so ``cuda:0`` is
            the first of them) or ``"cpu"`` (cores: the workers' CPU affinity is set to ``ids``, and
            torch's thread count to their share of them)
        ids: GPU indices (or the entries of a ``CUDA_VISIBLE_DEVICES`` such as UUIDs) or core numbers

    Example::

        >>> distsync.launch(train, cfg, nproc_per_node=2, devices=DeviceSet("cuda", (2, 3)))
        >>> distsync.launch(train, cfg, nproc_per_node=1, devices=DeviceSet("cpu", range(4, 8)))
    """

    kind: Literal["cuda", "cpu"]
    ids: tuple[int | str, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"DeviceSet kind must be 'cuda' or 'cpu', got {self.kind!r}")
        ids = tuple(self.ids)
        if self.kind == "cpu":
            if not all(isinstance(i, int) or str(i).isdigit() for i in ids):
                raise ValueError(f"CPU cores must be integers, got {ids!r}")
            ids = tuple(sorted({int(i) for i in ids}))
        else:
            ids = tuple(int(i) if str(i).isdigit() else str(i).strip() for i in ids)
            if len(set(ids)) != len(ids):
                raise ValueError(f"GPUs listed twice in {ids!r}")
        if not ids:
            raise ValueError(f"a DeviceSet needs at least one {'GPU' if self.kind == 'cuda' else 'core'}")
        object.__setattr__(self, "ids", ids)

    def __str__(self) -> str:
        if self.kind == "cuda":
            return "GPUs " + ",".join(map(str, self.ids))
        return ("core " if len(self.ids) == 1 else "cores ") + _ranges(self.ids)  # type: ignore[arg-type]


def _ranges(cores: tuple[int, ...]) -> str:
    """``0-3,8-11`` for ``(0, 1, 2, 3, 8, 9, 10, 11)``; ``5`` for a run of one core."""
    parts, start = [], cores[0]
    for prev, core in zip(cores, (*cores[1:], None), strict=True):
        if core != prev + 1:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = core
    return ",".join(parts)


# ----------------------------------------------------------------------------------- what is visible


def visible_devices(env: Mapping[str, str], gpu_count: int, cores: Iterable[int]) -> DeviceSet:
    """The devices a process may give its worlds: its GPUs if it has any, else its CPU cores.

    Pure: ``env`` is the environment, ``gpu_count`` what ``torch.cuda.device_count()`` says, ``cores`` the
    process's CPU affinity. GPUs are the entries of a ``CUDA_VISIBLE_DEVICES`` the user set (so the worlds
    get subsets of it), else ``0..gpu_count-1``. Inside a SLURM allocation (``SLURM_JOB_ID``) only the
    allocation's: the GPUs of ``SLURM_JOB_GPUS`` / ``SLURM_STEP_GPUS`` when no ``CUDA_VISIBLE_DEVICES``
    says more (a node without device cgroups), at most ``SLURM_GPUS_ON_NODE`` of them, and at most
    ``SLURM_CPUS_ON_NODE`` cores.
    """
    slurm = "SLURM_JOB_ID" in env
    if gpu_count > 0:
        listed = env.get("CUDA_VISIBLE_DEVICES")
        slurm_gpus = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
        if listed is not None:
            ids: list[int | str] = [e.strip() for e in listed.split(",") if e.strip()][:gpu_count]
        elif slurm and slurm_gpus:
            ids = [e.strip() for e in slurm_gpus.split(",") if e.strip()][:gpu_count]
        else:
            ids = list(range(gpu_count))
        on_node = env.get("SLURM_GPUS_ON_NODE", "")
        if slurm and on_node.isdigit():
            ids = ids[: int(on_node)]
        if ids:
            return DeviceSet("cuda", tuple(ids))
    usable = sorted(set(cores))
    on_node = env.get("SLURM_CPUS_ON_NODE", "")
    if slurm and on_node.isdigit() and int(on_node) > 0:
        usable = usable[: int(on_node)]
    return DeviceSet("cpu", tuple(usable))


def usable_cores() -> set[int]:
    """The cores this process may run on (its CPU affinity; every core where affinity is unknown)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def this_process_devices() -> DeviceSet:
    """:func:`visible_devices` of this process (``DISTSYNC_TEST_GPUS`` stands in for the GPU count)."""
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake is not None:
        gpu_count = int(fake)
    else:
        import torch

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return visible_devices(os.environ, gpu_count, usable_cores())


# ---------------------------------------------------------------------------------- the split


def split_devices(
    visible: DeviceSet, nproc_per_node: int, n_jobs: int | str, jobs: int | None = None
) -> list[DeviceSet]:
    """Disjoint device sets for up to ``n_jobs`` worlds of ``nproc_per_node`` ranks running at once.

    GPUs: ``nproc_per_node`` GPUs per world, the first ones first; GPUs left over stay idle. CPU: the
    cores cut into contiguous, nearly equal sets. ``n_jobs="auto"`` is as many worlds as fit: visible GPUs
    // ``nproc_per_node``, or cores // ``nproc_per_node`` (at least 1). ``jobs``, the number of jobs to
    run, caps the count, so fewer jobs than slots get more cores each.

    Raises:
        ValueError: in one line, for an ``n_jobs`` the GPUs cannot hold (or one job more than cores)
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node!r}")
    count = len(visible.ids)
    unit = "GPU" if visible.kind == "cuda" else "core"
    if n_jobs == "auto":
        wanted = count // nproc_per_node if visible.kind == "cuda" else max(1, count // nproc_per_node)
        if wanted == 0:
            raise ValueError(
                f"n_jobs=auto: a job of nproc_per_node={nproc_per_node} needs {nproc_per_node} GPUs, "
                f"{_seen(visible)}"
            )
    elif isinstance(n_jobs, int) and not isinstance(n_jobs, bool) and n_jobs >= 1:
        wanted = n_jobs
    else:
        raise ValueError(f"n_jobs must be an integer >= 1 or 'auto', got {n_jobs!r}")
    if visible.kind == "cuda" and wanted * nproc_per_node > count:
        raise ValueError(
            f"n_jobs={n_jobs} jobs of nproc_per_node={nproc_per_node} need {wanted * nproc_per_node} GPUs, "
            f"{_seen(visible)}"
        )
    if visible.kind == "cpu" and wanted > count:
        raise ValueError(f"n_jobs={n_jobs} jobs need a {unit} each, {_seen(visible)}")
    if jobs is not None:
        wanted = max(1, min(wanted, jobs))
    if visible.kind == "cuda":
        ids = visible.ids
        return [DeviceSet("cuda", ids[k * nproc_per_node : (k + 1) * nproc_per_node]) for k in range(wanted)]
    size, extra = divmod(count, wanted)
    sets, start = [], 0
    for k in range(wanted):
        end = start + size + (k < extra)
        sets.append(DeviceSet("cpu", visible.ids[start:end]))
        start = end
    return sets


def _seen(visible: DeviceSet) -> str:
    n = len(visible.ids)
    if visible.kind == "cuda":
        return f"{n} visible ({','.join(map(str, visible.ids))})"
    return f"this process has {n} ({_ranges(visible.ids)})"  # type: ignore[arg-type]


def nproc_on(devices: DeviceSet, nproc_per_node: int | str) -> int | str:
    """``nproc_per_node`` for a world on ``devices``: ``"gpu"``/``"cpu"``/``"auto"`` count the set's devices
    (not the machine's); a number must fit a GPU set, one GPU per rank.

    Raises:
        ValueError: for more ranks than the set has GPUs
    """
    if nproc_per_node in ("gpu", "cpu", "auto"):
        if nproc_per_node != "auto" and nproc_per_node != {"cuda": "gpu", "cpu": "cpu"}[devices.kind]:
            raise ValueError(f"nproc_per_node={nproc_per_node!r} does not fit devices on {devices}")
        return len(devices.ids)
    if devices.kind == "cuda" and str(nproc_per_node).isdigit() and int(nproc_per_node) > len(devices.ids):
        raise ValueError(f"nproc_per_node={nproc_per_node} ranks need a GPU each, devices has {devices}")
    return nproc_per_node


# ------------------------------------------------------------------------------- more ranks than cores


def crowding(ranks: int, cores: int, jobs: int = 1, threads: int = 1) -> str | None:
    """One line saying that ``jobs`` worlds of ``ranks`` ranks, each rank running ``threads`` threads, crowd
    ``cores`` cores, and what to do; None when every thread has a core.

    Ranks that share a core take turns on it, and every all-reduce waits for the last of them: a step takes
    several times longer than with one rank per core, which nothing else shows. Pure.
    """
    if jobs * ranks * threads <= cores:
        return None
    plural = "" if cores == 1 else "s"
    world = f"{ranks} ranks" if jobs == 1 else f"{jobs} jobs at once of {ranks} ranks each"
    why = "ranks that share a core wait for each other at every all-reduce (steps several times slower)"
    if jobs * ranks > cores:
        ranks_at_once = "nproc_per_node" if jobs == 1 else "hydra.launcher.n_jobs * nproc_per_node"
        return f"distsync: {world} on {cores} core{plural}: {why}; use {ranks_at_once} <= {cores}"
    fits = max(1, cores // (jobs * ranks))
    return (
        f"distsync: {world} * {threads} threads (OMP_NUM_THREADS={threads}) on {cores} core{plural}: {why}; "
        f"set OMP_NUM_THREADS={fits}"
    )


_crowding_said = False  # in this process, or in the one it was forked from (a packed sweep's launcher)


def warn_if_crowded(ranks: int, devices: DeviceSet | None = None, jobs: int = 1) -> None:
    """Print :func:`crowding`'s line to stderr if ``jobs`` worlds of ``ranks`` ranks crowd their cores; at
    most once per process.

    The cores are those of ``devices`` when it is a set of cores (shared by the ``jobs`` worlds), else this
    process's CPU affinity (GPU worlds still run a host thread per rank). Threads per rank: the user's
    ``OMP_NUM_THREADS``, else 1 (:func:`pin_process` gives each rank its share of the cores). A packed
    sweep's launcher says it for the whole sweep before it forks the jobs, which then say nothing more.
    """
    global _crowding_said
    if _crowding_said:
        return
    cores = len(devices.ids) if devices is not None and devices.kind == "cpu" else len(usable_cores())
    threads = os.environ.get("OMP_NUM_THREADS", "")
    line = crowding(ranks, cores, jobs, int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
        _crowding_said = True


# ------------------------------------------------------------------------------------- in the worker


def pin_process(devices: DeviceSet) -> None:
    """Confine this process to ``devices``; call it first thing in a worker, before CUDA or torch threads.

    GPUs: ``CUDA_VISIBLE_DEVICES``. Cores: the CPU affinity, and, unless ``OMP_NUM_THREADS`` is set,
    torch's intra-op threads: the cores shared among this node's ranks (``LOCAL_WORLD_SIZE``), since torch
    counted the whole machine's cores when it was imported.
    """
    if devices.kind == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices.ids))
        return
    if not sys.platform.startswith("linux"):
        return  # no CPU affinity to set elsewhere
    os.sched_setaffinity(0, devices.ids)  # type: ignore[arg-type]
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, len(devices.ids) // max(ranks, 1)))
