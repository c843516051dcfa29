"""distsync.launch and the hydra/launcher=torchrun plugin, alone and through the example app.

The example is copied outside the checkout and run as a user would: a single run, a sweep through the
plugin, an Optuna sweep and a sweep with a failing job.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from elastic_fns import end_as, fail_on_rank_one, flush_at_exit, put_rank, rank_and_config
from launching import copy_example_app, job_env, run_job

import distsync
from distsync.launching.elastic import LaunchError


def test_launch_runs_in_process_under_an_elastic_agent(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distsync.launch(rank_and_config, {"a": 1}, nproc_per_node=2) == (3, 4, {"a": 1})


def test_launch_returns_rank_zeros_value(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert distsync.launch(rank_and_config, {"a": 1}, nproc_per_node=2) == (0, 2, {"a": 1})


def test_a_failing_worker_raises_launch_error_naming_it(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(LaunchError, match="rank 1: ValueError: rank one refuses") as caught:
        distsync.launch(fail_on_rank_one, None, nproc_per_node=2)
    assert list(caught.value.failures) == [1]


def test_a_library_that_imports_only_in_the_launching_process_leaves_the_fork_server_running(tmp_path):
    """The fork server imports the libraries the launching process imported; one that raises in a fresh
    interpreter (here: unless the launching process set it up; torchvision's ops beside a CPU torch) is
    left to the workers that need it. Before: the server died on its RuntimeError and the launch failed
    with ``EOFError: unexpected EOF``."""
    library = tmp_path / "site-packages" / "picky_library.py"
    library.parent.mkdir()
    library.write_text(
        "import sys\n"
        "if not getattr(sys, 'picky_library_allowed', False):\n"
        "    raise RuntimeError('picky_library imports only where it was set up')\n"
    )
    # importable everywhere, but set up only here
    setup = _importable_everywhere(library.parent) + "sys.picky_library_allowed = True; import picky_library"
    assert _launch_in_a_subprocess("rank_and_config", setup=setup, nproc_per_node=2) == "result (0, 2, None)"


def test_workers_start_with_the_modules_the_launching_process_imported(tmp_path):
    """The fork server imports an installed library's modules one level down that the launching process
    imported (torch._dynamo: DDP and torch's optimizers import it, about two seconds of CPU in each
    worker); deeper ones are left to the workers that use them."""
    site = tmp_path / "site-packages"
    package = site / "probe_library"
    (package / "inner").mkdir(parents=True)
    record = "import os\nIMPORTED_BY = os.getpid()\n"
    for module in ("__init__.py", "first.py", "inner/__init__.py", "inner/deep.py"):
        (package / module).write_text(record)
    names = ["probe_library", "probe_library.first", "probe_library.inner.deep"]
    setup = _importable_everywhere(site) + "import probe_library.first, probe_library.inner.deep"
    line = _launch_in_a_subprocess("imported_before_the_worker", names, setup=setup, nproc_per_node=2)
    assert line == "result [True, True, False]"


def test_workers_start_with_dynamo_which_their_optimizers_and_ddp_import():
    """torch's optimizers and DDP import torch._dynamo when first built (about 1.5 s of CPU): the fork server
    imports it once for every worker, though the launching process never did."""
    setup = "import sys\nassert 'torch._dynamo' not in sys.modules"
    line = _launch_in_a_subprocess("modules_at_start", ["torch._dynamo"], setup=setup, nproc_per_node=2)
    assert line == "result [True]"


@pytest.mark.parametrize(("fn", "expected"), [("keep_until_exit", "result 0"), ("fail_holding", "failed [")])
def test_workers_end_without_interpreter_teardown(fn, expected):
    """A worker ends once its result or error is reported: a release that would block in interpreter
    teardown (a gloo group freed late, pytorch#190489) cannot hang the launch."""
    code = f"import elastic_fns; elastic_fns.launch_and_print({fn!r})"
    proc = run_job([sys.executable, "-c", code], cwd=Path(__file__).parent, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines()[-1].startswith(expected)


def _launch_in_a_subprocess(name: str, cfg=None, timeout: float = 120, setup: str = "", **options) -> str:
    """The last line ``elastic_fns.launch_and_print`` prints, from a process of its own (which runs the
    code ``setup`` first): a launch that hangs fails the test at the timeout instead of holding up the
    tests, and fork starts from a fresh process."""
    code = f"{setup}\nimport elastic_fns; elastic_fns.launch_and_print({name!r}, {cfg!r}, **{options!r})"
    proc = run_job([sys.executable, "-c", code], cwd=Path(__file__).parent, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def _importable_everywhere(site: Path) -> str:
    """Code that puts ``site`` on this process's path and on that of every process it starts."""
    return f"import os, sys; os.environ['PYTHONPATH'] = {str(site)!r}; sys.path.insert(0, {str(site)!r})\n"


_SYS_EXIT, _SYS_EXIT_0, _OS_EXIT_0 = {"how": "sys.exit"}, {"how": "sys.exit", "code": 0}, {"how": "os._exit"}


def test_ranks_that_end_without_a_result_leave_rank_zeros_value():
    """Before: every such launch waited forever (``sys.exit(0)``: a TypeError in distsync)."""
    ends = {1: _SYS_EXIT, 2: _SYS_EXIT_0, 3: _OS_EXIT_0}
    assert _launch_in_a_subprocess("end_as", ends, nproc_per_node=4) == "result rank 0 returned"


@pytest.mark.parametrize(
    ("ends", "expected"),
    [
        (
            {0: _SYS_EXIT, 1: _SYS_EXIT_0, 2: _OS_EXIT_0},
            "failed [0, 1, 2] rank 0 ended without a result: sys.exit() (exit code 0); rank 1 ended without "
            "a result: sys.exit(0) (exit code 0); rank 2 ended without a result: exit code 0",
        ),
        ({0: _OS_EXIT_0}, "failed [0] rank 0 ended without a result: exit code 0"),
    ],
    ids=["every-rank", "rank-0-alone"],
)
def test_rank_zero_without_a_result_is_a_launch_error_naming_the_ranks(ends, expected):
    assert _launch_in_a_subprocess("end_as", ends, nproc_per_node=3) == expected


@pytest.mark.parametrize(
    ("ends", "why"),
    [
        (
            {"how": "sys.exit", "code": "no data on this rank"},
            "sys.exit('no data on this rank') (exit code 1)",
        ),
        ({"how": "sys.exit", "code": 3}, "sys.exit(3) (exit code 3)"),
        ({"how": "os._exit", "code": 3}, "exit code 3"),
        ({"how": "KeyboardInterrupt"}, "KeyboardInterrupt (exit code 130)"),
        ({"how": "signal", "signal": signal.SIGKILL}, "killed by SIGKILL"),
        ({"how": "signal", "signal": signal.SIGTERM}, "killed by SIGTERM"),
    ],
    ids=["sys.exit(message)", "sys.exit(3)", "os._exit(3)", "KeyboardInterrupt", "SIGKILL", "SIGTERM"],
)
def test_launch_error_says_how_the_rank_ended(ends, why, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(LaunchError) as caught:
        distsync.launch(end_as, {1: ends}, nproc_per_node=2)
    assert str(caught.value) == f"1 worker(s) failed after 0 restart(s): rank 1: {why}"
    assert caught.value.failures[1][1] == why


def test_a_failing_ranks_traceback_goes_to_its_log_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(LaunchError, match="rank 1: ValueError: rank one refuses"):
        distsync.launch(fail_on_rank_one, None, nproc_per_node=2, log_dir=tmp_path)
    log = (tmp_path / "rank1.log").read_text()
    assert "rank 1 failed\nTraceback (most recent call last):" in log
    assert log.rstrip().endswith("ValueError: rank one refuses")


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_every_start_method_works(start_method):
    line = _launch_in_a_subprocess("rank_and_config", {"a": 1}, start_method=start_method)
    assert line == "result (0, 2, {'a': 1})"


_FILELESS_MAIN = """
import dataclasses, os
import distsync

@dataclasses.dataclass
class Config:
    scale: int = 3

@dataclasses.dataclass
class Result:
    value: int

def train(cfg):
    return Result(int(os.environ["RANK"]) * cfg.scale + 1)

result = distsync.launch(train, Config(), nproc_per_node=2, start_method=os.environ["START_METHOD"])
print(result, type(result) is Result)
"""


@pytest.mark.parametrize(
    ("how", "start_method"), [("-c", "spawn"), ("stdin", "spawn"), ("-c", "forkserver"), ("IPython", "spawn")]
)
def test_a_function_of_a_fileless_main_runs_on_every_rank(tmp_path, how, start_method):
    """As in a notebook: the function, its config dataclass and its result's class live in a ``__main__``
    that the workers cannot import; they travel by value, and the result comes back as a ``Result``
    (before: a LaunchError with torch's "To enable traceback" link)."""
    args, stdin = {
        "-c": ([sys.executable, "-c", _FILELESS_MAIN], None),
        "stdin": ([sys.executable, "-"], _FILELESS_MAIN),
        "IPython": ([sys.executable, "-m", "IPython", "--no-banner", "-c", _FILELESS_MAIN], None),
    }[how]
    if how == "IPython":
        pytest.importorskip("IPython")  # a notebook's kernel runs cells in IPython's __main__
    proc = subprocess.run(
        args,
        cwd=tmp_path,
        env=job_env(START_METHOD=start_method),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "Result(value=1) True"


def test_a_config_only_multiprocessing_may_pickle_still_reaches_the_workers(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    queue = multiprocessing.get_context("spawn").Queue()
    assert distsync.launch(put_rank, queue, nproc_per_node=2) == "put"
    assert sorted(queue.get(timeout=60) for _ in range(2)) == [0, 1]


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_what_a_rank_put_on_a_queue_arrives_though_its_queue_had_not_sent_it_when_the_rank_returned(
    start_method,
):
    """A rank ends once its queues' feeder threads have sent what ``put`` left them, as a process of
    ``multiprocessing`` does; before, a forked rank's last exit handler could end it first, and the items
    were lost. From a process of its own, as fork needs."""
    code = (
        "import multiprocessing, distsync, elastic_fns\n"
        "queue = multiprocessing.get_context('spawn').Queue()\n"
        "result = distsync.launch(elastic_fns.put_rank_pickled_slowly, queue, nproc_per_node=2,\n"
        f"                         start_method={start_method!r})\n"
        "print(result, sorted(queue.get(timeout=60) for _ in range(2)))\n"
    )
    proc = run_job([sys.executable, "-c", code], cwd=Path(__file__).parent, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "put [0, 1]"


_MAIN_WITH_A_QUEUE = """
import multiprocessing, os, sys
import distsync

def put_rank(queue):
    queue.put(int(os.environ["RANK"]))
    return "put"

if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Queue()
    result = distsync.launch(put_rank, queue, nproc_per_node=2, start_method=sys.argv[1])
    print(result, sorted(queue.get(timeout=60) for _ in range(2)))
"""


@pytest.mark.parametrize(
    ("how", "start_method"), [("-c", "forkserver"), ("script", "spawn"), ("script", "forkserver")]
)
def test_a_main_function_takes_a_config_only_multiprocessing_may_pickle(tmp_path, how, start_method):
    """The function of the launching ``__main__`` with a queue for its config, which is left to
    multiprocessing. ``python -c`` (a notebook alike): the function goes by value; before, cloudpickle met
    the queue's refusal and the launch raised RuntimeError. ``python script.py``: it goes by reference,
    and the worker finds it once it has imported the script; before, it went along with the queue, and a
    worker that had not imported the script yet could not unpickle it (AttributeError)."""
    if how == "-c":
        command = [sys.executable, "-c", _MAIN_WITH_A_QUEUE, start_method]
    else:
        script = tmp_path / "script.py"
        script.write_text(_MAIN_WITH_A_QUEUE)
        command = [sys.executable, str(script), start_method]
    proc = run_job(command, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "put [0, 1]"


def test_exit_handlers_of_the_workers_still_run(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert distsync.launch(flush_at_exit, str(tmp_path / "flushed"), nproc_per_node=2) == "registered"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flushed.0", "flushed.1"]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"nnodes": "two"}, "nnodes must be N or MIN:MAX, got 'two'"),
        ({"nnodes": 2}, "rdzv_endpoint must be host:port when nnodes > 1 outside SLURM"),
        ({"max_restarts": -1}, "max_restarts must be an integer >= 0, got -1"),
        ({"monitor_interval": 0}, "monitor_interval must be a number of seconds > 0, got 0"),
        ({"monitor_interval": -0.5}, "monitor_interval must be a number of seconds > 0, got -0.5"),
        ({"start_method": "thread"}, "start_method must be one of spawn, fork, forkserver, got 'thread'"),
    ],
)
def test_bad_options_are_refused_before_any_worker_starts(options, error):
    with pytest.raises(ValueError) as caught:
        distsync.launch(rank_and_config, None, **options)
    assert str(caught.value) == error


def test_a_port_held_by_another_program_is_refused_after_the_rendezvous_timeout(monkeypatch):
    """Something listens at the endpoint but never answers as a store: the launch says so within seconds,
    and gives up after the rendezvous timeout, naming the endpoint. What it says is read from a
    ``sys.stderr`` of the test's own: in one full-suite run capfd read nothing here, though the error the
    launch raises only after saying it was raised."""
    said = io.StringIO()
    monkeypatch.setattr(sys, "stderr", said)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = f"localhost:{listener.getsockname()[1]}"
        with pytest.raises(LaunchError) as caught:
            distsync.launch(rank_and_config, None, rdzv_endpoint=endpoint, rdzv_conf={"timeout": 3})
    assert str(caught.value) == (
        f"no rendezvous at {endpoint} within 3 s: a program that is not a torch store holds that port; "
        "choose another rdzv_endpoint"
    )
    assert f"{endpoint} accepts connections but does not answer as a rendezvous store" in said.getvalue()


# ------------------------------------------------------------------------------------- the example app


@pytest.fixture
def app(tmp_path) -> Path:
    """The example app, copied outside the checkout: it runs against the installed distsync."""
    return copy_example_app(tmp_path / "my_app")


def _run_app(app: Path, *args: str):
    return run_job([sys.executable, "app.py", *args, "steps=10"], cwd=app, timeout=240)


def _job_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("**/rank0.json"))


def _check_job(job: Path, world_size: int = 2) -> dict:
    """One run dir for the job: every rank's record in it, identical but for the pid, and per-rank logs."""
    records = [json.loads((job / f"rank{r}.json").read_text()) for r in range(world_size)]
    for record in records:
        record.pop("pid")
    assert all(record == records[0] for record in records), records
    assert records[0]["world_size"] == world_size
    assert Path(records[0]["output_dir"]) == job.resolve()
    assert (job / "logs" / f"rank{world_size - 1}.log").exists()
    return records[0]


def _accuracy(job: Path) -> float:
    return float(re.findall(r"held-out accuracy ([\d.]+)", (job / "logs" / "rank0.log").read_text())[-1])


@pytest.mark.slow
def test_example_single_run_is_a_two_rank_world(app):
    proc = _run_app(app)
    assert proc.returncode == 0
    (job,) = _job_dirs(app / "outputs")
    record = _check_job(job)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\.\d{6}", record["config"]["started"])
    assert _accuracy(job) > 0.8


@pytest.mark.slow
def test_example_sweep_through_the_plugin(app):
    proc = _run_app(app, "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "lr=0.05,0.2")
    assert proc.returncode == 0
    jobs = _job_dirs(app / "multirun")
    assert len(jobs) == 2
    records = [_check_job(job) for job in jobs]
    assert [r["config"]["lr"] for r in records] == [0.05, 0.2]
    assert [r["job_num"] for r in records] == [0, 1]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="packs two jobs on two cores at least")
def test_example_optuna_sweep_packs_its_batches_and_gets_rank_zeros_value(app):
    """distsync's Optuna sweeper runs hydra.sweeper.n_jobs=2 trials at once through the packed launcher,
    each a 2-rank world on cores of its own, and Optuna sees each world's rank 0 value."""
    proc = _run_app(
        app,
        "-m",
        "hydra/sweeper=distsync_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.direction=maximize",
        "hydra/launcher=torchrun",
        "hydra.launcher.nproc_per_node=2",
        "hydra.launcher.n_jobs=2",
        "lr=interval(0.01,0.3)",
    )
    assert proc.returncode == 0
    assert "setup plugin alembic" not in proc.stdout + proc.stderr  # optuna's import, quieted in the config
    assert proc.stdout.count("as 2 slots free, each a torchrun world on its own cores") == 1
    jobs = _job_dirs(app / "multirun")
    assert len(jobs) == 2
    cores = [set(_check_job(job)["cores"]) for job in jobs]
    assert cores[0] and cores[1] and not cores[0] & cores[1]
    (results,) = (app / "multirun").glob("**/optimization_results.yaml")
    best = yaml.safe_load(results.read_text())["best_value"]
    assert best == pytest.approx(max(_accuracy(job) for job in jobs), abs=1e-3)


@pytest.mark.slow
def test_example_sweep_through_submitit_local(app):
    """submitit's local executor (what hydra/launcher=submitit_slurm runs on a cluster) starts each job in
    its own process, which scans Hydra's plugins again: the job's config must still reach the ranks."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = _run_app(app, "-m", "hydra/launcher=submitit_local", "lr=0.05,0.2")
    assert proc.returncode == 0
    records = [_check_job(job) for job in _job_dirs(app / "multirun")]
    assert [r["config"]["lr"] for r in records] == [0.05, 0.2]
    assert _accuracy(_job_dirs(app / "multirun")[0]) > 0.5


@pytest.mark.slow
def test_a_failing_job_fails_alone_and_the_sweep_exits_non_zero(app):
    plugin = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"]
    proc = _run_app(app, "-m", *plugin, "fail_on_rank=1,-1")
    assert proc.returncode != 0
    assert "rank 1: RuntimeError: rank 1 fails on purpose" in proc.stderr
    jobs = _job_dirs(app / "multirun")
    assert len(jobs) == 2  # the job after the failing one still ran
    assert _accuracy(jobs[1]) > 0.8


def test_the_plugin_is_found_by_hydra(app):
    proc = run_job([sys.executable, "app.py", "--info", "plugins"], cwd=app)
    assert proc.returncode == 0
    assert "TorchrunLauncher" in proc.stdout


# ------------------------------------------------------------- an app whose config is a dataclass in __main__


@pytest.fixture
def structured_app(tmp_path) -> Path:
    shutil.copy(Path(__file__).parent / "structured_app.py", tmp_path / "app.py")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("face", ["launch", "plugin"])
def test_hydra_verbose_shows_the_workers_debug_lines_as_plain_hydra_does(structured_app, face):
    """On the console and in the job's app.log from rank 0, and in every rank's log file (before: only
    the INFO lines on the console and in the rank logs, an empty app.log)."""
    if face == "launch":
        args, job = ["hydra.run.dir=run"], structured_app / "run"
    else:
        plugin = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "face=task"]
        args, job = ["-m", *plugin, "hydra.sweep.dir=multirun"], structured_app / "multirun" / "0"
    proc = run_job([sys.executable, "app.py", *args, "hydra.verbose=true"], cwd=structured_app, timeout=240)
    assert proc.returncode == 0
    assert "[structured_app][DEBUG] - debug line of rank 0" in proc.stdout
    assert "line of rank 1" not in proc.stdout  # rank 0 alone talks to the console
    assert "[structured_app][DEBUG] - debug line of rank 0" in (job / "app.log").read_text()
    for rank in (0, 1):
        log = (job / "logs" / f"rank{rank}.log").read_text()
        assert f"[rank{rank}][structured_app][DEBUG] - debug line of rank {rank}" in log
        assert f"[rank{rank}][structured_app][INFO] - info line of rank {rank}" in log


@pytest.mark.slow
def test_a_sweep_goes_on_past_jobs_whose_ranks_end_without_a_result(structured_app):
    """Through the plugin, workers started by forkserver: job 0's rank 0 ends by ``sys.exit()`` (the job
    fails, saying so), job 1's rank 1 does (rank 0's value stands), job 2 runs (before: job 0 hung)."""
    plugin = [
        "hydra/launcher=torchrun",
        "hydra.launcher.nproc_per_node=2",
        "hydra.launcher.start_method=forkserver",
    ]
    args = ["-m", *plugin, "face=task", "end_on=0,1,-1", "hydra.sweep.dir=multirun"]
    proc = run_job([sys.executable, "app.py", *args], cwd=structured_app, timeout=240)
    assert proc.returncode != 0
    assert "LaunchError: rank 0 ended without a result: sys.exit() (exit code 0)" in proc.stderr
    jobs = structured_app / "multirun"
    assert not (jobs / "0" / "result.txt").exists()
    assert [(jobs / job / "result.txt").read_text() for job in ("1", "2")] == ["10", "10"]


@pytest.mark.slow
def test_submitit_local_runs_an_app_whose_config_is_a_dataclass_in_main(structured_app):
    """submitit's job process got the task function and the config class by value: they reach the ranks
    (before: PicklingError: Can't pickle <class '__main__.Config'>)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = ["-m", "hydra/launcher=submitit_local", "value=1,2", "hydra.sweep.dir=multirun"]
    proc = run_job([sys.executable, "app.py", *args], cwd=structured_app, timeout=240)
    assert proc.returncode == 0
    for job, value in (("0", 1), ("1", 2)):
        assert (structured_app / "multirun" / job / "result.txt").read_text() == str(value * 10)
        assert (structured_app / "multirun" / job / "rank1.txt").read_text() == str(value)
