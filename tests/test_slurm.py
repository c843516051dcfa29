"""The packaged job on a real SLURM cluster of two nodes on this machine (tests/slurm_cluster.py), submitted
as a user submits it: the job script of docs/training.md (examples/slurm/train.sbatch), Hydra's submitit
launcher, ``scontrol requeue``, ``scancel``, the time limit's ``--signal``. Each job is tiny (a two-block CNN
on synthetic data, one gloo worker per node); the jobs a test acts on while they train read that data at a
fixed pace (tests/paced_data.py), so they train for a known time on any machine, mostly asleep."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from launching import ROOT, SCRIPT, job_env, summary
from paced_data import PACED, paced
from slurm_cluster import SlurmCluster

from distsync.launching.slurm_rendezvous import slurm_port, slurm_ports
from distsync.testing import timeout_scale

pytestmark = pytest.mark.slow

JOB_SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
APP_SCRIPT = ROOT / "examples" / "slurm" / "app.sbatch"
TINY = [
    "data=synthetic",
    "model.channels=[8,8]",
    "trainer.max_steps=200",
    "trainer.log_every=5",
    "trainer.eval_every=1000",
    "trainer.checkpoint_every=1000",
    "trainer.monitor_interval=0.2",
]
# The jobs a test acts on while they train read their data at a fixed pace (tests/paced_data.py): a trial
# of N steps trains for N * SECONDS_PER_BATCH seconds or more on any machine, mostly asleep.
TINY_PACED = [*TINY, *PACED]
TRIAL = [option for option in TINY_PACED if not option.startswith("trainer.max_steps=")]  # a study's trial
# A job that trains until the test stops it (it has no end of its own): paced slower still, since each of its
# steps is CPU taken from the tests that run beside it, and it needs only to go on training
UNTIL_STOPPED = [*TINY, *paced(0.25), "trainer.max_steps=1000000"]
SMALL = ["--cpus-per-task=1"]  # the script asks for 4 cores per node: two jobs at once share these nodes

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")  # the states of a job that has ended


def user_env(cluster: SlurmCluster) -> dict[str, str]:
    """A user's shell on the login node: this venv's python first on PATH, the cluster's SLURM_CONF, and
    the jobs' PACED data importable."""
    env = {**job_env(), "SLURM_CONF": cluster.env["SLURM_CONF"]}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), cluster.env["PATH"]])
    return env


def submit(
    cluster: SlurmCluster,
    cwd: Path,
    *args: str,
    options: tuple[str, ...] = tuple(SMALL),
    script: Path = JOB_SCRIPT,
) -> str:
    """``sbatch [options] examples/slurm/train.sbatch args...`` from ``cwd``; the job id."""
    proc = subprocess.run(
        ["sbatch", "--parsable", *options, str(script), *args],
        cwd=cwd,
        env=user_env(cluster),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def output(cwd: Path, job_id: str) -> str:
    path = cwd / f"distsync-train-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    return [row["step"] for row in rows if row["kind"] == "train"]


def wait_until(
    condition, timeout: float, what: str | Callable[[], str], cluster: SlurmCluster | None = None
) -> None:
    """Poll ``condition``; on timeout raise naming ``what`` (a callable: what it says then), with the
    cluster's own account of its state."""
    deadline = time.monotonic() + timeout * timeout_scale()
    while not condition():
        if time.monotonic() > deadline:
            what = what() if callable(what) else what
            raise TimeoutError(what if cluster is None else f"{what}\n{cluster.state_report()}")
        time.sleep(0.2)


def processes_of(job_id: str) -> list[str]:
    """Command lines of the processes that run for ``job_id`` (SLURM puts SLURM_JOB_ID in each one's
    environment, which every process it starts inherits: the agents, the fork servers, the workers)."""
    found = []
    marker = f"\0SLURM_JOB_ID={job_id}\0".encode()
    for entry in Path("/proc").iterdir():
        try:
            environ = b"\0" + (entry / "environ").read_bytes()
            if marker in environ:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def start_requeued_now(cluster: SlurmCluster, job_id: str) -> None:
    """Once the requeued job waits for its begin time (SLURM holds a requeued job for 2 minutes), start it
    now, as an administrator may: once its first run has ended on the nodes, and in a later second.

    Each slurmd revokes the job's credential as it ends the first run, stamped with that second, and
    refuses a credential created in the same second or before ("Killing non-startable batch job: Job
    credential revoked"): that is what SLURM's hold is for. Started at once, a loaded node could still be
    ending the first run when the controller signs the new credential.
    """
    wait_until(
        lambda: cluster.job(job_id).get("Reason") == "BeginTime", 90, "the job is not requeued", cluster
    )
    wait_until(cluster.nodes_idle, 60, "the nodes are still ending the first run", cluster)
    time.sleep(1.05 - time.time() % 1.0)  # into the next second: later than any revocation's stamp
    cluster.scontrol("update", f"JobId={job_id}", "StartTime=now")


def resume_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if "after an interruption, resume it with: " in line]
    return line.split("after an interruption, resume it with: ", 1)[1]


def same_result(run_dir: Path, reference: Path) -> None:
    resumed, straight = summary(run_dir), summary(reference)
    assert resumed["steps"] == straight["steps"]
    for key in ("final_loss", "accuracy", "eval_loss"):
        assert resumed[key] == straight[key], key  # bit-identical, not close


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(slurm_cluster):
    """A test that failed half-way leaves no job running into the next one."""
    yield
    if slurm_cluster.run("squeue", "--noheader", "--format=%i", check=False).stdout.strip():
        slurm_cluster.run("scancel", "--partition=debug", check=False)
    wait_until(
        lambda: not slurm_cluster.job_processes(), 60, "the jobs' processes outlive scancel", slurm_cluster
    )


@pytest.fixture(scope="module")
def straight(slurm_cluster, tmp_path_factory) -> Path:
    """The run directory of the job script run once without interruption (TINY)."""
    cwd = tmp_path_factory.mktemp("straight")
    job_id = submit(slurm_cluster, cwd, *TINY)
    fields = slurm_cluster.wait_for(job_id, ENDED, timeout=240)
    assert fields["JobState"] == "COMPLETED", output(cwd, job_id)[-4000:]
    return cwd / "outputs" / "slurm" / f"{job_id}.0"


def test_the_docs_job_script_runs_one_world_over_two_nodes(slurm_cluster, straight):
    """examples/slurm/train.sbatch, as docs/training.md prints it: srun starts one agent per node, the agents
    meet on the first node at the job's own port, one world of 2 ranks trains in outputs/slurm/<job>.0."""
    job_id = straight.name.split(".")[0]
    s = summary(straight)
    assert s["world_size"] == 2 and s["steps"] == 200 and s["bn_buffers_in_sync"] is True
    log = output(straight.parents[2], job_id)
    assert log.count(f"waiting for 2 node(s) at 127.0.0.1:{slurm_port(job_id)} (rendezvous {job_id})") == 2
    # The resume command is srun with the step's shape: it runs as it is from a login node
    resume = resume_line(log)  # said once, by the first node
    srun = "srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --partition=debug"
    assert resume.startswith(f"{srun} {sys.executable} -m distsync.train trainer.nnodes=2 ")
    assert resume.endswith(f" hydra.run.dir={straight}")
    docs = (ROOT / "docs" / "training.md").read_text()
    assert JOB_SCRIPT.read_text() in docs  # the docs show the script that is tested here


def test_requeue_mid_training_resumes_to_the_same_bits(slurm_cluster, straight, tmp_path):
    """``scontrol requeue``: SLURM sends SIGTERM to every process of the job; every rank saves at its next
    logging step; the requeued job (same id, same run directory, nothing pinned) resumes there and ends
    bit-identical to the run never interrupted."""
    job_id = submit(slurm_cluster, tmp_path, *TINY)
    run_dir = tmp_path / "outputs" / "slurm" / f"{job_id}.0"
    wait_until(lambda: len(train_steps(run_dir)) >= 3, 120, "no training", slurm_cluster)
    reached = train_steps(run_dir)[-1]
    slurm_cluster.scontrol("requeue", job_id)
    slurm_cluster.wait_for(job_id, ("PENDING",), timeout=60)
    saved = [int(p.stem.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*.pt")]
    assert saved and min(saved) >= reached, output(tmp_path, job_id)[-3000:]  # no logged step lost
    start_requeued_now(slurm_cluster, job_id)
    fields = slurm_cluster.wait_for(job_id, ENDED, timeout=240)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", output(tmp_path, job_id)[-4000:]
    assert summary(run_dir)["resumed_from_step"] == min(saved)
    same_result(run_dir, straight)


def test_scancel_leaves_no_process_and_the_printed_command_resumes(slurm_cluster, straight, tmp_path):
    """``scancel``: every process of the job has ended a few seconds later (by itself, after saving: no
    SIGKILL after KillWait), and the command the job printed, run from the login node, resumes the run to
    the same bits."""
    job_id = submit(slurm_cluster, tmp_path, *TINY)
    run_dir = tmp_path / "outputs" / "slurm" / f"{job_id}.0"
    wait_until(lambda: len(train_steps(run_dir)) >= 3, 120, "no training", slurm_cluster)
    assert processes_of(job_id)
    cancelled = time.monotonic()
    slurm_cluster.run("scancel", job_id)
    wait_until(
        lambda: not processes_of(job_id), 20, lambda: f"still running: {processes_of(job_id)}", slurm_cluster
    )
    gone_after = time.monotonic() - cancelled
    assert gone_after < 25, gone_after  # before SLURM's KillWait (30 s) would SIGKILL them
    slurm_cluster.wait_for(job_id, ("CANCELLED",), timeout=60)
    (saved,) = (run_dir / "checkpoints").glob("step_*.pt")
    assert train_steps(run_dir)[-1] == int(saved.stem.removeprefix("step_"))
    resume = shlex.split(resume_line(output(tmp_path, job_id)))
    proc = subprocess.run(
        resume, cwd=tmp_path, env=user_env(slurm_cluster), capture_output=True, text=True,
        timeout=240 * timeout_scale(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == int(saved.stem.removeprefix("step_"))
    same_result(run_dir, straight)


def test_two_jobs_sharing_their_first_node_meet_apart(slurm_cluster, tmp_path):
    """Two 2-node jobs on the same nodes, the second submitted while the first trains and run whole while the
    first still trains: each meets in a store of its own (a port of its own job id), the second finishes as a
    world of its own, and the first trains on undisturbed until it is cancelled (it has no end of its own, so
    that a fast machine cannot finish it before the second has run)."""
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir(), second_dir.mkdir()
    first = submit(slurm_cluster, first_dir, *UNTIL_STOPPED)
    first_run = first_dir / "outputs" / "slurm" / f"{first}.0"
    wait_until(lambda: len(train_steps(first_run)) >= 2, 120, "the first job does not train", slurm_cluster)
    second = submit(slurm_cluster, second_dir, *TINY)
    second_run = second_dir / "outputs" / "slurm" / f"{second}.0"
    ended = slurm_cluster.wait_for(second, ENDED, 240)
    assert ended["JobState"] == "COMPLETED", output(second_dir, second)[-4000:]
    assert ended["NodeList"] == "n[1-2]"
    s = summary(second_run)
    assert s["world_size"] == 2 and s["steps"] == 200 and s["restarts"] == 0
    trained = len(train_steps(first_run))
    assert slurm_cluster.job(first)["JobState"] == "RUNNING"  # the second job ran while the first trained

    def trains_on() -> bool:
        return len(train_steps(first_run)) > trained

    wait_until(trains_on, 60, "the first job stopped training", slurm_cluster)
    slurm_cluster.run("scancel", first)
    assert slurm_cluster.wait_for(first, ENDED, 60)["NodeList"] == "n[1-2]"
    steps = train_steps(first_run)
    assert steps == sorted(set(steps)), output(first_dir, first)[-4000:]  # one world: no restart went back
    for job, cwd in ((first, first_dir), (second, second_dir)):
        rendezvous = f"waiting for 2 node(s) at 127.0.0.1:{slurm_port(job)} (rendezvous {job})"
        assert output(cwd, job).count(rendezvous) == 2, output(cwd, job)[-4000:]  # one line per node


def test_jobs_whose_ports_collide_and_a_port_another_program_holds_meet_apart(slurm_cluster, tmp_path):
    """Issue 53's two cases on real jobs: ids ``N`` and ``N + 10000`` (the same first port) on the same
    nodes, and a program that holds the second job's next port (it accepts connections, never answers).
    The first job meets at its first port and trains on; the second one's agents pass over the first job's
    store and the program, meet at its third port and finish; every node of both ends as it should."""
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir(), second_dir.mkdir()
    first = submit(slurm_cluster, first_dir, *UNTIL_STOPPED, options=(*SMALL, "--hold"))
    slurm_cluster.number_next_job(int(first) + 10000)
    slurm_cluster.scontrol("release", first)
    ports = slurm_ports(int(first) + 10000)
    assert ports[0] == slurm_port(first)
    first_run = first_dir / "outputs" / "slurm" / f"{first}.0"
    with socket.socket() as program:
        program.bind(("127.0.0.1", ports[1]))
        program.listen(16)
        trains = lambda: len(train_steps(first_run)) >= 2  # noqa: E731
        wait_until(trains, 120, "the first job does not train", slurm_cluster)
        started = time.monotonic()
        second = submit(slurm_cluster, second_dir, *TINY)
        assert second == str(int(first) + 10000)
        ended = slurm_cluster.wait_for(second, ENDED, 240)
        took = time.monotonic() - started
    assert ended["JobState"] == "COMPLETED", output(second_dir, second)[-4000:]
    s = summary(second_dir / "outputs" / "slurm" / f"{second}.0")
    assert s["world_size"] == 2 and s["steps"] == 200 and s["restarts"] == 0
    trained = len(train_steps(first_run))
    assert slurm_cluster.job(first)["JobState"] == "RUNNING"
    trains_on = lambda: len(train_steps(first_run)) > trained  # noqa: E731
    wait_until(trains_on, 60, "the first job stopped training", slurm_cluster)
    slurm_cluster.run("scancel", first)
    slurm_cluster.wait_for(first, ENDED, 60)
    steps = train_steps(first_run)
    assert steps == sorted(set(steps)), output(first_dir, first)[-4000:]  # one world: no restart went back
    for job, cwd, port in ((first, first_dir, ports[0]), (second, second_dir, ports[2])):
        rendezvous = f"waiting for 2 node(s) at 127.0.0.1:{port} (rendezvous {job})"
        assert output(cwd, job).count(rendezvous) == 2, output(cwd, job)[-4000:]  # one line per node
    print(f"the second job, from sbatch to its end: {took:.1f} s")


def test_a_two_job_sweep_through_hydras_submitit_launcher(slurm_cluster, tmp_path):
    """``hydra/launcher=submitit_slurm`` with ``nodes=2``: each job of the sweep is a SLURM job of two nodes,
    one world of its own; the resume command each prints is the sweep's own command, sweep dir pinned."""
    sweep = tmp_path / "sweep"
    command = [
        sys.executable, str(SCRIPT), "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2",
        "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
        "trainer.nnodes=2", "trainer.nproc_per_node=1", "optim.lr=0.1,0.05", *TINY,
        f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=tmp_path, env=user_env(slurm_cluster), capture_output=True, text=True,
        timeout=400 * timeout_scale(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for job in ("0", "1"):
        s = summary(sweep / job)
        assert s["world_size"] == 2 and s["steps"] == 200 and s["restarts"] == 0
    assert summary(sweep / "0")["final_loss"] != summary(sweep / "1")["final_loss"]  # two runs, not one
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.err"))
    printed = {
        line.split("resume it with: ", 1)[1] for line in logs.splitlines() if "resume it with: " in line
    }
    assert printed == {shlex.join([*command[:-1], f"hydra.sweep.dir={sweep}"])}
    ports = set(re.findall(r"waiting for 2 node\(s\) at 127\.0\.0\.1:(\d+)", logs))
    assert len(ports) == 2  # each job at its own port


def test_signal_before_the_time_limit_saves_and_the_script_requeues_itself(slurm_cluster, tmp_path):
    """``#SBATCH --signal=TERM@...`` (here ``--time=2 --signal=TERM@30``): SLURM sends SIGTERM to the job's
    steps ahead of the time limit; every rank saves, the script sees 143 and requeues the job, which resumes
    where it saved."""
    job_id = submit(
        slurm_cluster, tmp_path, *UNTIL_STOPPED,
        options=(*SMALL, "--time=2", "--signal=TERM@30"),
    )  # fmt: skip
    run_dir = tmp_path / "outputs" / "slurm" / f"{job_id}.0"
    # SLURM checks time limits every 30 s: the signal comes 60 to 90 s after the start
    wait_until(
        lambda: slurm_cluster.job(job_id).get("Restarts") == "1",
        150,
        "the job was not requeued",
        slurm_cluster,
    )
    log = output(tmp_path, job_id)
    assert "stopped by SIGTERM at step" in log, log[-3000:]
    step = max(int(p.stem.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert train_steps(run_dir)[-1] == step, log[-3000:]  # saved at the step it stopped, none lost
    start_requeued_now(slurm_cluster, job_id)
    rank0 = run_dir / "logs" / "rank0.log"
    wait_until(
        lambda: "resumed from" in rank0.read_text() or slurm_cluster.job(job_id).get("JobState") in ENDED,
        120,
        "the requeued job did not resume",
        slurm_cluster,
    )
    assert "resumed from" in rank0.read_text(), f"{slurm_cluster.state_report()}\n{output(tmp_path, job_id)}"
    assert f"step {step}" in [line for line in rank0.read_text().splitlines() if "resumed from" in line][-1]
    slurm_cluster.run("scancel", job_id)
    slurm_cluster.wait_for(job_id, ("CANCELLED",), timeout=60)


def test_the_docs_app_script_runs_a_sweep_of_two_node_worlds(slurm_cluster, tmp_path):
    """examples/slurm/app.sbatch, as docs/your_app.md prints it, with the example app: each job of the sweep
    is one world of both nodes, the jobs one after the other in the allocation, each meeting anew."""
    app = tmp_path / "app"
    shutil.copytree(
        ROOT / "examples" / "hydra_app", app, ignore=shutil.ignore_patterns("outputs", "multirun")
    )
    job_id = submit(slurm_cluster, app, "steps=10", "lr=0.05,0.2", script=APP_SCRIPT)
    fields = slurm_cluster.wait_for(job_id, ENDED, timeout=300)
    log = (app / f"hydra-app-{job_id}.out").read_text(errors="replace")
    assert fields["JobState"] == "COMPLETED", log[-4000:]
    sweep = app / "outputs" / "slurm" / job_id
    for job, lr in (("0", 0.05), ("1", 0.2)):
        records = [json.loads((sweep / job / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        assert [r["world_size"] for r in records] == [2, 2] and records[0]["config"]["lr"] == lr
    assert (ROOT / "examples" / "slurm" / "app.sbatch").read_text() in (
        ROOT / "docs" / "your_app.md"
    ).read_text()


OPTUNA_SWEEP = [
    "hydra/sweeper=distsync_optuna", "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2",
    "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
    "trainer.nnodes=2", "trainer.nproc_per_node=1", "hydra.sweeper.n_jobs=2",
]  # fmt: skip


def _optuna_sweep(cluster: SlurmCluster, cwd: Path, *args: str, **popen: object) -> subprocess.Popen:
    pytest.importorskip("optuna")
    command = [sys.executable, str(SCRIPT), "-m", *OPTUNA_SWEEP, *args, f"hydra.sweep.dir={cwd / 'sweep'}"]
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen(command, cwd=cwd, env=user_env(cluster), **output, **popen)


def _sweep_jobs(sweep: Path) -> list[str]:
    """The SLURM job ids of a submitit sweep (submitit's folders, ``<sweep>/.submitit/<job id>``)."""
    return sorted((p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()), key=int)


def _seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp).timestamp()


def test_an_optuna_study_through_submitit_keeps_both_slots_busy(slurm_cluster, tmp_path):
    """``hydra/sweeper=distsync_optuna`` through ``hydra/launcher=submitit_slurm``, ``n_jobs=2``: six trials
    of unequal length (50 or 600 paced steps: about 3 or 30 s of training), each a SLURM job of two nodes; a
    trial is submitted as soon as a slot frees, so the study takes little more than half the sum of its
    jobs' run times (batches of two would wait for the longer trial of each pair, 27 s or more)."""
    grid = ["hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=6", "hydra.sweeper.direction=maximize"]
    space = ["trainer.max_steps=choice(50,600)", "optim.lr=choice(0.05,0.1,0.2)"]
    driver = _optuna_sweep(slurm_cluster, tmp_path, *grid, *space, *TRIAL)
    out, _ = driver.communicate(timeout=900 * timeout_scale())
    assert driver.returncode == 0, out[-4000:]
    sweep = tmp_path / "sweep"
    jobs = {job: slurm_cluster.job(job) for job in _sweep_jobs(sweep)}
    assert len(jobs) == 6 and all(f["JobState"] == "COMPLETED" for f in jobs.values()), jobs
    spans = sorted((_seconds(f["StartTime"]), _seconds(f["EndTime"])) for f in jobs.values())
    ran = sum(end - start for start, end in spans)
    wall = max(end for _, end in spans) - spans[0][0]
    ends = sorted(end for _, end in spans)
    # the k-th job to start takes the slot the (k-2)-th job to end freed; SLURM's end comes after the
    # job's result, at the end of its teardown, so a wait may be below 0
    gaps = [start - ends[k] for k, (start, _) in enumerate(spans[2:])]
    print(f"6 trials, n_jobs=2: wall {wall:.0f} s, jobs' run times {ran:.0f} s (half: {ran / 2:.0f} s), "
          f"ratio {wall / (ran / 2):.3f}; slot waits {gaps}")  # fmt: skip
    assert max(gaps) <= 15, gaps  # a sweep's turn and SLURM's scheduling, not the other slot's trial
    steps = sorted(summary(p)["steps"] for p in sweep.iterdir() if p.name.isdigit())
    assert steps == [50, 50, 50, 600, 600, 600]
    assert wall <= 1.15 * ran / 2 + 15, (wall, ran, gaps)


def test_an_optuna_trial_whose_slurm_job_is_cancelled_resumes_in_its_job_dir(slurm_cluster, tmp_path):
    """``scancel`` of one trial's SLURM job mid-training: its ranks save a checkpoint and the job ends
    without a result; the sweep launches the trial again (same number, same job dir), which resumes from
    that checkpoint, and the study goes on: every trial completes and the sweep exits 0."""
    args = ["hydra.sweeper.n_trials=3", "hydra.sweeper.direction=maximize", "optim.lr=interval(0.05,0.2)"]
    driver = _optuna_sweep(slurm_cluster, tmp_path, *args, "trainer.max_steps=200", *TRIAL)  # >= 10 s
    sweep = tmp_path / "sweep"
    run_dir = sweep / "1"

    def job_of_trial_1() -> str | None:
        for job in _sweep_jobs(sweep) if (sweep / ".submitit").is_dir() else []:
            logs = "".join(p.read_text(errors="replace") for p in (sweep / ".submitit" / job).glob("*_log.*"))
            if f"run directory {run_dir};" in logs:
                return job
        return None

    wait_until(
        lambda: len(train_steps(run_dir)) >= 3 and job_of_trial_1(), 300, "trial #1 trains", slurm_cluster
    )
    job_id = job_of_trial_1()
    slurm_cluster.run("scancel", job_id)
    slurm_cluster.wait_for(job_id, ("CANCELLED",), timeout=60)
    wait_until(lambda: not processes_of(job_id), 30, "the cancelled job's processes end", slurm_cluster)
    (saved,) = (run_dir / "checkpoints").glob("step_*.pt")
    saved_at = int(saved.stem.removeprefix("step_"))
    out, _ = driver.communicate(timeout=900 * timeout_scale())
    assert driver.returncode == 0, out[-4000:]
    assert "trial #1: its job ended without a result" in out, out[-4000:]
    s = summary(run_dir)
    assert s["steps"] == 200 and s["resumed_from_step"] == saved_at, s
    steps = train_steps(run_dir)
    assert steps == sorted(set(steps)) and steps[-1] == 200  # went on from the checkpoint, not from 0
    study = out.split("Study distsync: ", 1)[1].splitlines()[0]
    assert study.startswith("3 of n_trials=3 finished"), study
    import yaml

    assert yaml.safe_load((run_dir / "trial.yaml").read_text())["state"] == "COMPLETE"
    assert yaml.safe_load((run_dir / "trial.yaml").read_text())["relaunched"] == 1
    for job in ("0", "2"):
        assert summary(sweep / job)["steps"] == 200


def _trial_dirs_training(sweep: Path, numbers: tuple[str, ...], steps: int) -> bool:
    return all(len(train_steps(sweep / n)) >= steps for n in numbers if (sweep / n).is_dir()) and all(
        (sweep / n).is_dir() for n in numbers
    )


def test_an_optuna_driver_sigtermed_mid_study_and_run_again_finishes_each_trial_once(slurm_cluster, tmp_path):
    """SIGTERM to the sweep while two trials' SLURM jobs train: it cancels them (their ranks save a
    checkpoint), leaves their trials to the next sweep and exits 143. The same command, run again, resumes
    both under their numbers in their job dirs from those checkpoints (its heartbeat said the first sweep
    ended: no grace period to wait) and runs the third: exit 0, every trial finished once, none refused."""
    args = ["hydra.sweeper.n_trials=3", "hydra.sweeper.direction=maximize", "optim.lr=interval(0.05,0.2)"]
    args += ["trainer.max_steps=200", *TRIAL]  # paced: 10 s or more, stopped at about step 20
    sweep = tmp_path / "sweep"
    driver = _optuna_sweep(slurm_cluster, tmp_path, *args)
    wait_until(
        lambda: _trial_dirs_training(sweep, ("0", "1"), 3), 300, "trials #0 and #1 train", slurm_cluster
    )
    jobs = _sweep_jobs(sweep)
    driver.send_signal(signal.SIGTERM)
    out, _ = driver.communicate(timeout=120 * timeout_scale())
    assert driver.returncode == 143, out[-4000:]
    for job in jobs:
        slurm_cluster.wait_for(job, ("CANCELLED",), timeout=60)
        wait_until(lambda job=job: not processes_of(job), 30, f"job {job}'s processes end", slurm_cluster)
    saved_at = {}
    for n in ("0", "1"):
        (saved,) = (sweep / n / "checkpoints").glob("step_*.pt")
        saved_at[n] = int(saved.stem.removeprefix("step_"))
    again = _optuna_sweep(slurm_cluster, tmp_path, *args)
    out_again, _ = again.communicate(timeout=900 * timeout_scale())
    assert again.returncode == 0, out_again[-4000:]
    assert "Study distsync: 3 of n_trials=3 finished" in out_again, out_again[-4000:]
    for n in ("0", "1"):
        s = summary(sweep / n)
        assert s["steps"] == 200 and s["resumed_from_step"] == saved_at[n], (n, s)
        steps = train_steps(sweep / n)
        assert steps == sorted(set(steps)) and steps[-1] == 200, n  # went on, not over
        assert f"trial #{n}: its sweep is gone (it ended); this sweep resumes it" in out_again
    assert summary(sweep / "2")["steps"] == 200
    assert not (sweep / "3").exists()  # no fourth trial: the interrupted ones kept their numbers
    assert "UpdateFinishedTrialError" not in out + out_again


def test_an_optuna_driver_killed_with_sigkill_leaves_its_job_to_the_next_sweep(slurm_cluster, tmp_path):
    """SIGKILL to the sweep while a trial's SLURM job trains: the job trains on. The same command, run again
    once the killed sweep's heartbeat is grace_period old, takes the trial over and waits for that job
    rather than submitting it again, then runs the other trial: every trial one SLURM job, its result told,
    the sweep exits 0. (Run again sooner, with its one slot, it would run the other trial first and take
    the first one over only after it, as told by its world if its job ended meanwhile.)"""
    heartbeat = 2  # seconds; a sweep silent for twice that (grace_period) is gone
    args = ["hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1", "hydra.sweeper.direction=maximize"]
    args += [f"hydra.sweeper.heartbeat_interval={heartbeat}", "optim.lr=interval(0.05,0.2)"]
    # paced: 30 s or more, still training when the rerun takes it over (the 4.5 s wait and the rerun's start
    # after the kill took longer than 1000 unpaced steps on a loaded machine: the rerun found it complete)
    args += ["trainer.max_steps=600", *TRIAL]
    sweep = tmp_path / "sweep"
    driver = _optuna_sweep(slurm_cluster, tmp_path, *args)
    wait_until(lambda: _trial_dirs_training(sweep, ("0",), 3), 300, "trial #0 trains", slurm_cluster)
    (job,) = _sweep_jobs(sweep)
    driver.kill()
    driver.communicate(timeout=60)
    killed = time.monotonic()
    assert slurm_cluster.job(job)["JobState"] == "RUNNING"
    time.sleep(2 * heartbeat + 0.5)  # the last beat came before the kill: now past the grace period
    again = _optuna_sweep(slurm_cluster, tmp_path, *args)
    out, _ = again.communicate(timeout=900 * timeout_scale())
    assert again.returncode == 0, out[-4000:]
    assert "Study distsync: 2 of n_trials=2 finished" in out, out[-4000:]
    assert "this sweep resumes it in its job dir (its job slurm:" in out, out
    assert len(_sweep_jobs(sweep)) == 2  # trial #0's job waited for, not submitted again
    assert slurm_cluster.job(job).get("JobState", "COMPLETED") == "COMPLETED"
    s = summary(sweep / "0")
    assert s["steps"] == 600 and not s.get("resumed_from_step"), s
    assert summary(sweep / "1")["steps"] == 600
    silent = re.search(r"trial #0: its sweep is gone \(its heartbeat silent for ([0-9.]+) s\)", out)
    assert silent and float(silent.group(1)) > 2 * heartbeat, out  # past grace_period
    print(f"trial #0 taken over after a heartbeat silence of {silent.group(1)} s; the rerun took "
          f"{time.monotonic() - killed:.1f} s from the kill")  # fmt: skip


def test_an_optuna_trial_whose_slurm_job_is_requeued_resumes_in_the_same_job(slurm_cluster, tmp_path):
    """``scontrol requeue`` of one trial's SLURM job mid-training (as a preemption requeues it): its ranks
    save a checkpoint, the same job runs again in the trial's job dir and resumes there; the sweep waits
    for that job's result (no second job, no relaunch), and the study ends with every trial complete."""
    args = ["hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1", "hydra.sweeper.direction=maximize"]
    args += ["optim.lr=interval(0.05,0.2)", "trainer.max_steps=300", *TRIAL]  # paced: 15 s or more
    sweep = tmp_path / "sweep"
    driver = _optuna_sweep(slurm_cluster, tmp_path, *args)
    wait_until(lambda: _trial_dirs_training(sweep, ("0",), 3), 300, "trial #0 trains", slurm_cluster)
    (job,) = _sweep_jobs(sweep)
    slurm_cluster.scontrol("requeue", job)
    slurm_cluster.wait_for(job, ("PENDING",), timeout=60)
    (saved,) = (sweep / "0" / "checkpoints").glob("step_*.pt")
    start_requeued_now(slurm_cluster, job)
    out, _ = driver.communicate(timeout=900 * timeout_scale())
    assert driver.returncode == 0, out[-4000:]
    assert "Study distsync: 2 of n_trials=2 finished" in out, out[-4000:]
    assert slurm_cluster.job(job).get("Restarts", "1") == "1"
    assert "ended without a result" not in out and len(_sweep_jobs(sweep)) == 2  # one job per trial
    s = summary(sweep / "0")
    assert s["steps"] == 300 and s["resumed_from_step"] == int(saved.stem.removeprefix("step_")), s
