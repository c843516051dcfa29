"""Packed sweeps: jobs side by side, each in a job process on its own devices (launching.packing), and
``hydra.launcher.n_jobs`` end to end through the example app."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import copy_example_app, job_env, run_job

from distsync.launching.device_split import DeviceSet, crowding
from distsync.launching.packing import run_packed

ROOT = Path(__file__).resolve().parents[1]

SLOTS = [DeviceSet("cpu", (0,)), DeviceSet("cpu", (1,))]


def _job(k: int, seconds: float, slot: DeviceSet) -> tuple[int, tuple, float, float, int]:
    start = time.monotonic()
    time.sleep(seconds)
    if k == 2:
        raise ValueError("job 2 fails on purpose")
    if k == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return k, slot.ids, start, time.monotonic(), os.getpid()


def test_jobs_come_back_in_order_each_failure_alone_and_slots_never_shared():
    seconds = [0.6, 0.1, 0.1, 0.1, 0.1]  # job 0 ends last: the others pass it
    started = []
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # an earlier launch's
    ended = run_packed(
        [functools.partial(_job, k, s) for k, s in enumerate(seconds)], SLOTS, lambda k, s: started.append(k)
    )
    assert started == [0, 1, 2, 3, 4]
    assert [e.value[0] if e.error is None else None for e in ended] == [0, 1, None, None, 4]
    assert isinstance(ended[2].error, ValueError) and str(ended[2].error) == "job 2 fails on purpose"
    assert "ended without a result (killed by SIGKILL)" in str(ended[3].error)
    runs = [e.value for e in ended if e.error is None]
    assert len({pid for *_, pid in runs}) == 3 and os.getpid() not in {pid for *_, pid in runs}
    for a, b in itertools.combinations(runs, 2):  # jobs that overlapped in time ran on different slots
        if a[2] < b[3] and b[2] < a[3]:
            assert a[1] != b[1], (a, b)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # given back


def _talks(k: int, slot: DeviceSet) -> int:
    """Writes from this process and from a worker it starts, to both streams, a line in two pieces, and
    ends with a line without its newline."""
    print(f"out {k} a", flush=True)
    print(f"err {k} a", file=sys.stderr, flush=True)
    code = f"import sys; print('out {k} worker'); sys.stderr.write('err {k} worker no newline')"
    subprocess.run([sys.executable, "-c", code], check=True)
    sys.stdout.write(f"out {k} ")
    sys.stdout.flush()
    time.sleep(0.2)  # the other job writes meanwhile
    sys.stdout.write(f"b\nout {k} last")
    sys.stdout.flush()
    return k


def test_every_line_of_a_packed_job_carries_its_tag(capfd):
    ended = run_packed(
        [functools.partial(_talks, k) for k in range(2)], SLOTS, tag=lambda k: f"[job {k + 5}] "
    )
    assert [e.value for e in ended] == [0, 1]
    out, err = capfd.readouterr()
    for k in range(2):
        tag = f"[job {k + 5}] "
        assert sorted(line for line in out.splitlines() if line.startswith(tag)) == sorted(
            [f"{tag}out {k} a", f"{tag}out {k} worker", f"{tag}out {k} b", f"{tag}out {k} last"]
        )
        assert sorted(line for line in err.splitlines() if line.startswith(tag)) == sorted(
            [f"{tag}err {k} a", f"{tag}err {k} worker no newline"]
        )
    assert all(line.startswith("[job ") for line in out.splitlines() + err.splitlines() if line)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_running_job_and_starts_no_other(tmp_path, signum):
    script = Path(__file__).parent / "packing_script.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], env=job_env(), stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum, stderr
    assert f"stopped by {signal.Signals(signum).name}; every running job was stopped" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started-0", "started-1"]
    for pid in (int((tmp_path / name).read_text()) for name in ("started-0", "started-1")):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ------------------------------------------------------------------------------ through the example app


def _app(tmp_path: Path) -> Path:
    return copy_example_app(tmp_path / "my_app")


def _records(sweep: Path) -> list[dict]:
    return [
        json.loads((sweep / str(k) / "rank0.json").read_text()) for k in range(len(list(sweep.glob("*/"))))
    ]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="packs two jobs on two cores at least")
def test_a_packed_sweep_runs_two_jobs_at_a_time_on_disjoint_cores(tmp_path):
    """4 one-rank jobs, 2 at a time: every job ran in its own directory, in order, the two running at once
    on disjoint cores; the failing job failed alone and the sweep exits non-zero."""
    app = _app(tmp_path)
    plugin = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=1", "hydra.launcher.n_jobs=2"]
    args = ["-m", *plugin, "lr=0.05,0.2", "fail_on_rank=-1,0", "steps=10", "hydra.sweep.dir=multirun"]
    proc = run_job([sys.executable, "app.py", *args], cwd=app, timeout=240)
    assert proc.returncode != 0
    assert "RuntimeError: rank 0 fails on purpose" in proc.stderr
    records = _records(app / "multirun")
    assert [(r["job_num"], r["config"]["lr"], r["config"]["fail_on_rank"]) for r in records] == [
        (0, 0.05, -1),
        (1, 0.05, 0),
        (2, 0.2, -1),
        (3, 0.2, 0),
    ]
    cores = [set(r["cores"]) for r in records]
    assert cores[0] and cores[1] and not cores[0] & cores[1]  # jobs 0 and 1 started together
    assert len({r["pid"] for r in records}) == 4
    lines = [line.split("] ")[-1] for line in proc.stdout.splitlines() if " on core" in line]
    assert len(lines) == 4 and re.fullmatch(r"\t#0 : lr=0.05 fail_on_rank=-1 steps=10 on core \d+", lines[0])
    for job in (0, 2):  # the jobs that did not fail trained to the end
        assert "held-out accuracy" in (app / "multirun" / str(job) / "logs" / "rank0.log").read_text()
    # On the console, each job's lines (its workers' included) carry its number
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "held-out accuracy" in line]
    assert said and {line.split("] ", 1)[0] + "]" for line in said} == {"[job 0]", "[job 2]"}
    failed = [line for line in proc.stderr.splitlines() if "rank 0 fails on purpose" in line]
    assert any(line.startswith("[job 1] ") for line in failed)  # in the job's own lines, where it happened
    assert not any(line.startswith(("[job 0] ", "[job 2] ")) for line in failed)


@pytest.mark.slow
def test_a_packed_sweep_gives_each_job_its_gpus(tmp_path):
    """Four (faked) GPUs, two-rank jobs, n_jobs=auto: two jobs at a time, GPUs 0,1 and 2,3."""
    app = _app(tmp_path)
    plugin = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "hydra.launcher.n_jobs=auto"]
    args = ["-m", *plugin, "lr=0.05,0.2", "steps=5", "hydra.sweep.dir=multirun"]
    proc = run_job([sys.executable, "app.py", *args], cwd=app, timeout=240, DISTSYNC_TEST_GPUS="4")
    assert proc.returncode == 0
    assert [r["cuda_visible_devices"] for r in _records(app / "multirun")] == ["0,1", "2,3"]
    assert "2 at a time, each on its own GPUs" in proc.stdout
    # Both jobs' ranks share this machine's cores: said once for the sweep (on 2 cores), never per job
    crowded = crowding(2, len(os.sched_getaffinity(0)), jobs=2)
    said = [line for line in proc.stderr.splitlines() if line.startswith("distsync: ")]
    assert said == ([crowded] if crowded else []), proc.stderr


def test_an_n_jobs_the_gpus_cannot_hold_is_refused_before_any_job(tmp_path):
    app = _app(tmp_path)
    plugin = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "hydra.launcher.n_jobs=3"]
    proc = run_job([sys.executable, "app.py", "-m", *plugin, "lr=0.1,0.2"], cwd=app, DISTSYNC_TEST_GPUS="4")
    assert proc.returncode != 0
    assert "hydra.launcher: n_jobs=3 jobs of nproc_per_node=2 need 6 GPUs, 4 visible (0,1,2,3)" in proc.stderr
    assert not (app / "multirun").exists() or not list((app / "multirun").glob("**/rank0.json"))


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="packs two jobs on two cores at least")
def test_the_workers_of_every_packed_job_fork_from_the_launchers_server_in_their_jobs_group(tmp_path):
    """One fork server, started with the launcher (torch and the app's libraries imported once), forks
    the workers of every job: no job waits for a server of its own. Each worker still runs in its job's
    process group (a terminal's Ctrl-C reaches it through its agent only)."""
    app = ROOT / "tests" / "optuna_app.py"
    plugin = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=1", "hydra.launcher.n_jobs=2"]
    args = ["-m", *plugin, "x=0,1,2,3", "steps=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = run_job([sys.executable, str(app), *args], tmp_path, timeout=240)
    assert proc.returncode == 0
    records = [json.loads((tmp_path / "sweep" / str(k) / "rank0.json").read_text()) for k in range(4)]
    assert len({r["ppid"] for r in records}) == 1  # one fork server for the four jobs
    assert len({r["pgid"] for r in records}) == 4 and records[0]["ppid"] not in {r["pgid"] for r in records}
