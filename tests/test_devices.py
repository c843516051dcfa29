"""distsync.devices: which devices a process sees, how they are split among worlds, and what each worker
of a world pinned with ``distsync.launch(devices=...)`` sees (GPUs faked: only the environment is read)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from elastic_fns import all_ranks_devices
from launching import run_job

import distsync
from distsync.launching.device_split import (
    DeviceSet,
    crowding,
    nproc_on,
    split_devices,
    this_process_devices,
    visible_devices,
)


def _ids(sets: list[DeviceSet]) -> list[tuple]:
    return [s.ids for s in sets]


def test_gpus_are_split_nproc_per_node_per_job_the_first_first():
    gpus = visible_devices({}, 8, range(4))
    assert gpus == DeviceSet("cuda", tuple(range(8)))
    assert _ids(split_devices(gpus, 2, "auto")) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert _ids(split_devices(gpus, 3, "auto")) == [(0, 1, 2), (3, 4, 5)]  # GPUs 6 and 7 stay idle
    assert _ids(split_devices(gpus, 2, 2)) == [(0, 1), (2, 3)]
    assert _ids(split_devices(gpus, 2, "auto", jobs=3)) == [(0, 1), (2, 3), (4, 5)]


def test_a_users_cuda_visible_devices_is_split_within():
    gpus = visible_devices({"CUDA_VISIBLE_DEVICES": "6, 4,GPU-1f2e,7"}, 4, range(4))
    assert _ids(split_devices(gpus, 2, "auto")) == [(6, 4), ("GPU-1f2e", 7)]
    assert str(split_devices(gpus, 2, "auto")[0]) == "GPUs 6,4"
    # more entries than GPUs: only as many as torch sees
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3,2,1"}, 2, []).ids == (3, 2)


def test_inside_a_slurm_allocation_only_its_devices():
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_GPUS": "2,5",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_CPUS_ON_NODE": "4",
    }
    assert visible_devices(slurm, 8, range(16)).ids == (2, 5)  # no device cgroup: torch sees all 8
    assert visible_devices({**slurm, "CUDA_VISIBLE_DEVICES": "0,1"}, 2, range(16)).ids == (0, 1)
    assert visible_devices({**slurm, "SLURM_GPUS_ON_NODE": "1"}, 8, range(16)).ids == (2,)
    cores = visible_devices(slurm, 0, range(16))
    assert cores == DeviceSet("cpu", (0, 1, 2, 3))
    assert visible_devices({}, 0, range(16)).ids == tuple(range(16))  # outside SLURM: the affinity


def test_cores_are_split_in_nearly_equal_contiguous_sets():
    cores = visible_devices({}, 0, [0, 1, 2, 3, 4, 5, 6, 7, 9])
    assert _ids(split_devices(cores, 1, 3)) == [(0, 1, 2), (3, 4, 5), (6, 7, 9)]
    assert _ids(split_devices(cores, 2, "auto")) == [(0, 1, 2), (3, 4), (5, 6), (7, 9)]
    assert _ids(split_devices(cores, 1, "auto", jobs=2)) == [(0, 1, 2, 3, 4), (5, 6, 7, 9)]
    assert _ids(split_devices(cores, 16, "auto")) == [tuple(cores.ids)]  # fewer cores than ranks: one job
    assert [str(s) for s in split_devices(DeviceSet("cpu", (0, 1)), 1, 2)] == ["core 0", "core 1"]
    assert str(DeviceSet("cpu", (0, 1, 2, 3, 8, 9))) == "cores 0-3,8-9"
    assert str(DeviceSet("cpu", (0, 2, 3, 5))) == "cores 0,2-3,5"


@pytest.mark.parametrize(
    ("visible", "nproc", "n_jobs", "message"),
    [
        (
            DeviceSet("cuda", (0, 1, 2, 3)),
            2,
            3,
            "n_jobs=3 jobs of nproc_per_node=2 need 6 GPUs, 4 visible (0,1,2,3)",
        ),
        (
            DeviceSet("cuda", (4, 5)),
            4,
            "auto",
            "n_jobs=auto: a job of nproc_per_node=4 needs 4 GPUs, 2 visible (4,5)",
        ),
        (DeviceSet("cpu", (0, 1)), 1, 3, "n_jobs=3 jobs need a core each, this process has 2 (0-1)"),
        (DeviceSet("cpu", (0, 1)), 1, 0, "n_jobs must be an integer >= 1 or 'auto', got 0"),
        (DeviceSet("cpu", (0, 1)), 1, "many", "n_jobs must be an integer >= 1 or 'auto', got 'many'"),
    ],
)
def test_what_the_devices_cannot_hold_is_refused_in_one_line(visible, nproc, n_jobs, message):
    with pytest.raises(ValueError) as refused:
        split_devices(visible, nproc, n_jobs)
    assert str(refused.value) == message


def test_a_world_on_a_device_set_counts_its_devices():
    assert nproc_on(DeviceSet("cuda", (2, 3)), "gpu") == 2
    assert nproc_on(DeviceSet("cpu", range(4)), "auto") == 4
    assert nproc_on(DeviceSet("cuda", (2, 3)), 1) == 1
    with pytest.raises(ValueError, match="need a GPU each"):
        nproc_on(DeviceSet("cuda", (2, 3)), 3)
    with pytest.raises(ValueError, match="at least one core"):
        DeviceSet("cpu", ())


def test_the_fake_gpu_count_stands_for_torchs(monkeypatch):
    monkeypatch.setenv("DISTSYNC_TEST_GPUS", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,0,2")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert this_process_devices() == DeviceSet("cuda", (3, 1, 0, 2))
    monkeypatch.setenv("DISTSYNC_TEST_GPUS", "0")
    assert this_process_devices() == DeviceSet("cpu", tuple(sorted(os.sched_getaffinity(0))))


def test_every_worker_sees_its_worlds_gpus_and_cores(monkeypatch):
    """One world pinned to GPUs (no GPU needed: a worker only reads CUDA_VISIBLE_DEVICES), one to a core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # the user's: the workers' replaces it
    seen = distsync.launch(all_ranks_devices, None, nproc_per_node="gpu", devices=DeviceSet("cuda", (5, 7)))
    assert [(rank, gpus) for rank, gpus, _, _ in seen] == [(0, "5,7"), (1, "5,7")]
    core = max(os.sched_getaffinity(0))
    seen = distsync.launch(all_ranks_devices, None, nproc_per_node=2, devices=DeviceSet("cpu", (core,)))
    assert [(rank, cores, threads) for rank, _, cores, threads in seen] == [(0, [core], 1), (1, [core], 1)]


@pytest.mark.parametrize(
    ("ranks", "cores", "jobs", "threads", "line"),
    [
        (2, 2, 1, 1, None),
        (4, 8, 2, 1, None),  # 2 jobs at once, 4 ranks each, on 8 cores
        (2, 4, 1, 2, None),
        (
            8, 2, 1, 1,
            "distsync: 8 ranks on 2 cores: ranks that share a core wait for each other at every all-reduce "
            "(steps several times slower); use nproc_per_node <= 2",
        ),
        (
            4, 2, 2, 1,
            "distsync: 2 jobs at once of 4 ranks each on 2 cores: ranks that share a core wait for each "
            "other at every all-reduce (steps several times slower); use hydra.launcher.n_jobs * "
            "nproc_per_node <= 2",
        ),
        (
            2, 1, 1, 1,
            "distsync: 2 ranks on 1 core: ranks that share a core wait for each other at every all-reduce "
            "(steps several times slower); use nproc_per_node <= 1",
        ),
        (
            2, 4, 1, 4,
            "distsync: 2 ranks * 4 threads (OMP_NUM_THREADS=4) on 4 cores: ranks that share a core wait for "
            "each other at every all-reduce (steps several times slower); set OMP_NUM_THREADS=2",
        ),
    ],
)  # fmt: skip
def test_ranks_or_threads_beyond_the_cores_are_said_in_one_line(ranks, cores, jobs, threads, line):
    assert crowding(ranks, cores, jobs, threads) == line


def test_a_world_that_crowds_its_cores_is_said_once_per_process():
    """One rank on a core: nothing; two ranks on it, twice: one line, the first time."""
    code = (
        "import os, distsync, elastic_fns\n"
        "core = distsync.DeviceSet('cpu', (max(os.sched_getaffinity(0)),))\n"
        "for nproc in (1, 2, 2):\n"
        "    distsync.launch(elastic_fns.rank_and_config, None, nproc_per_node=nproc, devices=core)\n"
    )
    proc = run_job([sys.executable, "-c", code], cwd=Path(__file__).parent, timeout=120)
    assert proc.returncode == 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("distsync: ")]
    assert said == [
        "distsync: 2 ranks on 1 core: ranks that share a core wait for each other at every all-reduce "
        "(steps several times slower); use nproc_per_node <= 1"
    ], proc.stderr
