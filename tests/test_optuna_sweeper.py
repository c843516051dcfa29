"""hydra/sweeper=distsync_optuna: Hydra's Optuna sweeper's configs on current Optuna, trials that never wait
for a batch, pruning that stops every rank of a trial's world together, failures, and resuming."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import _vision
import pytest
import yaml
from launching import ROOT, job_env, run_job

from distsync.testing import timeout_scale

optuna = pytest.importorskip("optuna")
APP = ROOT / "tests" / "optuna_app.py"
SWEEPER = ["-m", "hydra/sweeper=distsync_optuna"]
PACKED = ["hydra/launcher=torchrun", "hydra.launcher.n_jobs=2"]


def _sweep(tmp_path: Path, *args: str, cwd: Path | None = None, timeout: float = 240):
    return run_job(
        [sys.executable, str(APP), *SWEEPER, f"hydra.sweep.dir={tmp_path / 'sweep'}", *args],
        cwd or tmp_path, timeout=timeout, PYTHONPATH=_vision.python_path(),
    )  # fmt: skip


def _records(sweep: Path, rank: int = 0) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob(f"*/rank{rank}.json"))]


def _study(storage: str, name: str) -> optuna.Study:
    from distsync.tuning import storage_from_url

    return optuna.load_study(study_name=name, storage=storage_from_url(storage))


def test_apps_without_optuna_see_nothing_of_the_sweeper(monkeypatch):
    """Hydra imports every plugin module on every run: without Optuna (distsync's default install) the
    sweeper's module imports silently, and choosing the sweeper there says what to install."""
    scan = (
        "import sys, warnings\nsys.modules['optuna'] = None\nwarnings.simplefilter('always')\n"
        "from hydra.core.plugins import Plugins\nPlugins.instance()\nprint('scanned')"
    )
    proc = subprocess.run([sys.executable, "-c", scan], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "scanned" in proc.stdout, proc.stderr
    assert "distsync_optuna_sweeper" not in proc.stderr

    from hydra_plugins.distsync_optuna_sweeper import sweeper

    for found, named in ((None, "Optuna is not installed"), (2, "Optuna [0-9.]+ is installed")):
        monkeypatch.setattr(sweeper, "optuna_major", lambda found=found: found)
        with pytest.raises(ImportError, match=f"needs Optuna 4 or newer, and {named}.*distsync\\[optuna\\]"):
            sweeper.DistsyncOptunaSweeper()


def test_search_space_syntax_of_hydras_optuna_sweeper():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from hydra_plugins.distsync_optuna_sweeper._space import search_space

    space, fixed = search_space(
        [
            "a=interval(0.1, 1.0)",
            "b=tag(log, interval(0.001, 1.0))",
            "c=int(interval(1, 8))",
            "d=choice(relu, tanh)",
            "e=range(1, 9, step=2)",
            "f=range(-5.5, 5.5, step=0.5)",
            "g=tag(log, int(interval(1, 64)))",
            "i=interval(1, 8)",
            "h=3",
        ]
    )
    assert space["a"] == FloatDistribution(0.1, 1.0)
    assert space["b"] == FloatDistribution(0.001, 1.0, log=True)
    assert space["c"] == IntDistribution(1, 8)
    assert space["d"] == CategoricalDistribution(["relu", "tanh"])
    assert space["e"] == IntDistribution(1, 9, step=2)
    assert space["f"] == FloatDistribution(-5.5, 5.5, step=0.5)
    assert space["g"] == IntDistribution(1, 64, log=True)
    assert space["i"] == FloatDistribution(1.0, 8.0)  # Hydra reads interval bounds as floats
    assert fixed == {"h": "3"}


# Hydra's Optuna sweeper's example config (plugins/hydra_optuna_sweeper/example/conf/config.yaml), with the
# one line that switches to distsync_optuna.
_SPHERE_CONFIG = """\
defaults:
  - override hydra/sweeper: distsync_optuna
  - override hydra/sweeper/sampler: tpe

hydra:
  sweeper:
    sampler:
      seed: 123
    direction: minimize
    study_name: sphere
    storage: null
    n_trials: 20
    n_jobs: 1
    params:
      x: range(-5.5, 5.5, step=0.5)
      y: choice(-5 ,0 ,5)

x: 1
y: 1
z: 1

# if true, simulate a failure by raising an exception
error: false
"""
_SPHERE = """\
import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def sphere(cfg: DictConfig) -> float:
    x: float = cfg.x
    y: float = cfg.y
    if cfg.get("error", False):
        raise RuntimeError("cfg.error is True")
    return x**2 + y**2


if __name__ == "__main__":
    sphere()
"""


@pytest.mark.slow
def test_a_config_from_hydras_optuna_docs_runs_with_the_one_line_switch(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(_SPHERE_CONFIG)
    (tmp_path / "sphere.py").write_text(_SPHERE)
    command = [sys.executable, "sphere.py", "--multirun", "hydra.sweep.dir=sweep"]
    proc = run_job(command, tmp_path, timeout=240)
    assert proc.returncode == 0
    results = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert results["name"] == "optuna" and set(results["best_params"]) == {"x", "y"}
    assert results["best_value"] == results["best_params"]["x"] ** 2 + results["best_params"]["y"] ** 2
    table = (tmp_path / "sweep" / "optuna_trials.md").read_text()
    assert table.count("| complete |") == 20


@pytest.mark.slow
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="two 1-core trials at once")
def test_a_trial_starts_as_soon_as_a_slot_frees(tmp_path):
    """1-core trials of unequal lengths (0.4 s or 12 s of work), two at a time: whenever a trial ends while
    trials remain, the next one starts on its core after a world's start-up (about 3 s here: a packed job
    process starts its agent and fork server), not when the other trial of a batch ends."""
    proc = _sweep(
        tmp_path, *PACKED, "hydra.sweeper.n_trials=6", "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.sampler.seed=0", "steps=choice(1,30)", "step_seconds=0.4", "x=interval(0,1)",
    )  # fmt: skip
    assert proc.returncode == 0
    records = sorted(_records(tmp_path / "sweep"), key=lambda r: r["start"])
    assert len(records) == 6
    for ended in sorted(records, key=lambda r: r["end"])[:-2]:  # each end but the last two: trials remained
        successors = [r["start"] - ended["end"] for r in records if r["start"] > ended["end"]]
        assert successors and min(successors) < 6.0, (ended, records)  # a world's start, not a batch's wait


@pytest.mark.slow
def test_a_pruned_trial_stops_every_rank_of_its_world_at_the_same_step(tmp_path):
    proc = _sweep(
        tmp_path, "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "hydra/sweeper/sampler=grid",
        "hydra/sweeper/pruner=threshold", "hydra.sweeper.pruner.upper=5", "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=1", "x=choice(0,10)", "steps=6",
    )  # fmt: skip
    assert proc.returncode == 0
    sweep = tmp_path / "sweep"
    for job in sorted(p for p in sweep.iterdir() if p.is_dir()):
        ranks = [json.loads((job / f"rank{r}.json").read_text()) for r in (0, 1)]
        trial = yaml.safe_load((job / "trial.yaml").read_text())
        if ranks[0]["x"] == 10:  # its first value, 11, is above the threshold: pruned at step 0
            assert [r["pruned_at"] for r in ranks] == [0, 0] and trial["state"] == "PRUNED"
        else:
            assert [r["pruned_at"] for r in ranks] == [None, None] and trial["state"] == "COMPLETE"
    assert "**pruned** at step 0" in (sweep / "optuna_trials.md").read_text()
    assert yaml.safe_load((sweep / "optimization_results.yaml").read_text())["best_params"] == {"x": 0}


@pytest.mark.slow
def test_a_failed_trial_is_told_failed_the_study_goes_on_and_the_sweep_exits_non_zero(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"  # an RDB storage (the other tests: journal files)
    proc = _sweep(
        tmp_path, "hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1",
        f"hydra.sweeper.storage='{storage}'", "hydra.sweeper.study_name=fails", "x=choice(0,10)",
        "fail_when=5",
    )  # fmt: skip
    assert proc.returncode != 0 and "x=10 fails on purpose" in proc.stderr
    states = sorted(t.state.name for t in _study(storage, "fails").trials)
    assert states == ["COMPLETE", "FAIL"]
    assert yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())["best_value"] == 0


def _trials(storage: str, name: str) -> dict[int, optuna.trial.FrozenTrial]:
    return {t.number: t for t in _study(storage, name).trials}


# How long a trial that the test stops runs (0.5 s steps, never all taken): on a loaded machine a job
# can take 100 s and more to start, and a trial that ended before the other started could not be stopped.
UNTIL_STOPPED = "steps=100000"


def _wait_for(condition, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout * timeout_scale()
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.2)


def _runs(job_dir: Path) -> list[dict]:
    """Rank 0's runs of the trial in ``job_dir``, as each wrote itself to ``started0.jsonl`` as it began."""
    return [json.loads(line) for line in (job_dir / "started0.jsonl").read_text().splitlines()]


def _check_job_dirs(sweep: Path, trials: dict) -> None:
    """Every job dir holds the trial of its number, and the files its own world wrote."""
    for job in (p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()):
        trial = trials[int(job.name)]
        assert yaml.safe_load((job / "trial.yaml").read_text())["number"] == trial.number
        assert Path(trial.user_attrs["job_dir"]) == job.resolve()
        if (job / "rank0.json").exists():
            assert json.loads((job / "rank0.json").read_text())["x"] == trial.params["x"], job


def _unshare_works(*options: str) -> bool:
    try:
        return subprocess.run(["unshare", *options, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_fresh_pid_namespace(command: list[str]) -> list[str]:
    """``command`` as PID 1 of a PID namespace of its own (a restarted container: the same pid again)."""
    return ["unshare", "--pid", "--fork", "--mount-proc", *command]


def _on_host(name: str, command: list[str]) -> list[str]:
    """``command`` where the host name is ``name`` (a sweep requeued onto another node)."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh", *command]


def _kill_9(proc: subprocess.Popen) -> None:
    """SIGKILL to the sweep: ``proc`` itself, or the child that ``unshare --fork`` runs it as (its PID 1)."""
    target = proc.pid
    if Path(f"/proc/{proc.pid}/exe").resolve().name == "unshare":
        target = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
    os.kill(target, signal.SIGKILL)
    proc.wait(60)


RESUMED_IN = {
    "the same host": (lambda c: c, lambda c: c),
    "a fresh PID namespace": (_in_fresh_pid_namespace, _in_fresh_pid_namespace),
    "another host name": (lambda c: c, lambda c: _on_host("requeued-elsewhere", c)),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", list(RESUMED_IN))
def test_a_killed_sweep_run_again_resumes_its_trial_in_its_job_dir(tmp_path, where):
    """Killed with SIGKILL during its second trial, the sweep is run again as it was, where the killed one
    ran, or as PID 1 of a fresh PID namespace after the killed one was PID 1 of its own (a restarted
    container: its pid is the new sweep's), or under another host name (a requeued sweep job): the killed
    sweep's heartbeat is silent, so the new sweep takes the trial over under its number and resumes it in
    its job dir, from the step it had saved; the study ends with n_trials completed, each once."""
    first_in, again_in = RESUMED_IN[where]
    if where != "the same host" and not _unshare_works("--pid", "--fork", "--mount-proc", "--uts"):
        pytest.skip("unshare cannot make PID and UTS namespaces here (it needs root or user namespaces)")
    args = [
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.heartbeat_interval=1",
        "x=interval(0,1)",
        "steps=8",
        "step_seconds=0.5",
        "checkpoint=true",
    ]
    sweep = tmp_path / "sweep"
    command = [sys.executable, str(APP), *SWEEPER, f"hydra.sweep.dir={sweep}", *args]
    first = subprocess.Popen(first_in(command), cwd=tmp_path, env=job_env(PYTHONPATH=_vision.python_path()))
    storage = f"journal:{sweep / 'optuna_journal.log'}"
    saved = sweep / "1" / "step0.txt"
    _wait_for(lambda: saved.exists() and int(saved.read_text() or -1) >= 2, "the second trial's step 2")
    _kill_9(first)
    killed_after = int(saved.read_text())
    first_x = json.loads((sweep / "0" / "rank0.json").read_text())["x"]
    assert _trials(storage, "distsync")[1].state.name == "RUNNING"
    proc = run_job(again_in(command), tmp_path, timeout=240, PYTHONPATH=_vision.python_path())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trials = _trials(storage, "distsync")
    assert [t.state.name for t in trials.values()] == ["COMPLETE"] * 3
    assert trials[0].params["x"] == first_x
    runs = _runs(sweep / "1")
    assert [r["first_step"] for r in runs] == [0, killed_after + 1]  # went on, not over
    assert yaml.safe_load((sweep / "1" / "trial.yaml").read_text())["resumed_from_a_gone_sweep"]
    _check_job_dirs(sweep, trials)
    assert "1 of n_trials=3 finished, 1 running" in proc.stdout  # at the start: #0 done, #1 running
    assert "trial #1: its sweep is gone (" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_trial_whose_rank_0_returned_before_the_kill_counts_as_finished(tmp_path):
    """Two-rank trials whose rank 1 ends 60 s after rank 0 returned: the sweep killed in that time, the
    resumed sweep tells the trial complete with the value rank 0 returned, in its own job dir."""
    plugin = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"]
    args = [*plugin, "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1", "x=interval(0,1)", "steps=1"]
    sweep = tmp_path / "sweep"
    command = [sys.executable, str(APP), *SWEEPER, f"hydra.sweep.dir={sweep}", *args, "linger=60"]
    first = subprocess.Popen(command, cwd=tmp_path, env=job_env(PYTHONPATH=_vision.python_path()))
    storage = f"journal:{sweep / 'optuna_journal.log'}"
    _wait_for(lambda: (sweep / "0" / "rank0.json").exists(), "the first trial's rank 0 to return")
    deadline = time.monotonic() + 30 * timeout_scale()
    while "distsync_result" not in _trials(storage, "distsync")[0].user_attrs:  # rank 0 records it next
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait(60)
    assert _trials(storage, "distsync")[0].state.name == "RUNNING"
    proc = _sweep(tmp_path, *args, "linger=0")
    assert proc.returncode == 0
    trials = _trials(storage, "distsync")
    x = json.loads((sweep / "0" / "rank0.json").read_text())["x"]
    assert trials[0].state.name == "COMPLETE" and trials[0].values == [x]
    assert [t.state.name for t in trials.values()] == ["COMPLETE", "COMPLETE"]
    _check_job_dirs(sweep, trials)


@pytest.mark.slow
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="two 1-core trials at once")
def test_ctrl_c_of_a_packed_study_stops_its_trials_and_the_next_sweep_resumes_them(tmp_path):
    """Ctrl-C while two trials run: their worlds stop, the trials stay running, marked interrupted, and the
    sweep exits 130; the same command resumes both at once (the stopped sweep's heartbeat says it ended),
    each under its number in its job dir, from its last saved step, and runs the third."""
    args = [
        *PACKED,
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=2",
        "x=interval(0,1)",
        "step_seconds=0.5",
        "checkpoint=true",
    ]
    sweep = tmp_path / "sweep"
    command = [sys.executable, str(APP), *SWEEPER, f"hydra.sweep.dir={sweep}", *args, UNTIL_STOPPED]
    first = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=job_env(PYTHONPATH=_vision.python_path()),
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: len(list(sweep.glob("*/step0.txt"))) == 2, "two trials' first steps")
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=120 * timeout_scale())
    assert first.returncode == 130, stderr
    storage = f"journal:{sweep / 'optuna_journal.log'}"
    trials = _trials(storage, "distsync")
    assert [(t.state.name, t.user_attrs.get("distsync_interrupted")) for t in trials.values()] == [
        ("RUNNING", True),
        ("RUNNING", True),
    ]
    assert "interrupted (the next sweep resumes it)" in (sweep / "optuna_trials.md").read_text()
    stopped_at = {n: int((sweep / str(n) / "step0.txt").read_text()) for n in (0, 1)}

    started = time.monotonic()
    proc = _sweep(tmp_path, *args, "steps=6")
    assert proc.returncode == 0
    assert time.monotonic() - started < 60 * timeout_scale()  # no wait for a grace period
    trials = _trials(storage, "distsync")
    assert [t.state.name for t in trials.values()] == ["COMPLETE", "COMPLETE", "COMPLETE"]
    for n in (0, 1):
        runs = _runs(sweep / str(n))
        assert [r["first_step"] for r in runs] == [0, stopped_at[n] + 1], n
    _check_job_dirs(sweep, trials)


@pytest.mark.slow
def test_a_seeded_study_run_again_draws_new_parameters(tmp_path):
    """A seeded sampler, the study run again for more trials: the new trials' parameters are not the first
    trials' again (the sampler is seeded with the seed plus the trials the study has)."""
    args = ["hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=0", "x=interval(0,1)", "steps=1"]
    assert _sweep(tmp_path, *args, "hydra.sweeper.n_trials=2").returncode == 0
    assert _sweep(tmp_path, *args, "hydra.sweeper.n_trials=4").returncode == 0
    trials = _trials(f"journal:{tmp_path / 'sweep' / 'optuna_journal.log'}", "distsync")
    xs = [trials[n].params["x"] for n in range(4)]
    assert len(set(xs)) == 4, xs


@pytest.mark.slow
def test_two_sweeps_of_one_study_share_its_n_trials(tmp_path):
    """n_trials counts the study's trials, every sweep's: two sweeps run at once on one storage and study
    end with n_trials between them (one more at most: each may ask at the same moment), and say so."""
    storage = f"journal:{tmp_path / 'journal.log'}"
    args = [
        f"hydra.sweeper.storage='{storage}'", "hydra.sweeper.study_name=shared", "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=1", "x=interval(0,1)", "steps=4", "step_seconds=0.5",
    ]  # fmt: skip
    commands = [[sys.executable, str(APP), *SWEEPER, f"hydra.sweep.dir={tmp_path / d}", *args] for d in "ab"]
    env = job_env(PYTHONPATH=_vision.python_path())
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    sweeps = [subprocess.Popen(c, cwd=tmp_path, env=env, **output) for c in commands]
    outputs = [s.communicate(timeout=300 * timeout_scale())[0] for s in sweeps]
    assert [s.returncode for s in sweeps] == [0, 0], outputs
    trials = _study(storage, "shared").trials
    assert all(t.state.name == "COMPLETE" for t in trials) and 4 <= len(trials) <= 5
    ran = [int(re.search(r"this sweep ran (\d+)", out).group(1)) for out in outputs]
    assert sum(ran) == len(trials) and min(ran) >= 1, outputs
    assert all("counts the study's trials, every sweep's" in out for out in outputs)


def test_a_search_space_optuna_cannot_draw_from_is_one_line():
    from hydra.errors import ConfigCompositionException

    from hydra_plugins.distsync_optuna_sweeper._space import search_space

    for override, said in [
        ("x=interval(1,0)", "x=interval(1,0): its low end 1.0 is above its high end 0.0"),
        (
            "x=tag(log,interval(0,1))",
            "x=tag(log,interval(0,1)): a log scale needs a low end above 0, got 0.0",
        ),
        ("n=range(5,1)", "n=range(5,1): its low end 5 is above its high end 1"),
    ]:
        with pytest.raises(ConfigCompositionException) as refused:
            search_space([override])
        assert str(refused.value) == said


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("x=interval(1,0)", "x=interval(1,0): its low end 1.0 is above its high end 0.0"),
        (
            "x=tag(log,interval(0,1))",
            "x=tag(log,interval(0,1)): a log scale needs a low end above 0, got 0.0",
        ),
        (
            "hydra.sweeper.direction=maximise",
            "hydra.sweeper.direction must be minimize or maximize, or a list of them (one per objective), "
            "got 'maximise'",
        ),
    ],
)
def test_what_optuna_would_refuse_is_one_line_on_the_command_line(tmp_path, override, said):
    proc = _sweep(tmp_path, override, "hydra.sweeper.n_trials=1")
    assert proc.returncode == 1
    assert [line for line in proc.stderr.splitlines() if line.strip()][0] == said, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "sweep" / "0").exists()


@pytest.mark.slow
def test_a_list_of_directions_from_the_command_line_makes_a_multi_objective_study(tmp_path):
    """``direction=[minimize,maximize]`` (an OmegaConf ListConfig), as the docs offer: a study of two
    objectives, whose Pareto front the sweep writes; the trials' reports are no pruning material there."""
    proc = _sweep(
        tmp_path, "hydra.sweeper.direction=[minimize,maximize]", "hydra.sweeper.n_trials=3", "objectives=2",
        "x=interval(0,1)", "hydra.sweeper.sampler.seed=0",
    )  # fmt: skip
    assert proc.returncode == 0
    study = _study(f"journal:{tmp_path / 'sweep' / 'optuna_journal.log'}", "distsync")
    assert [d.name for d in study.directions] == ["MINIMIZE", "MAXIMIZE"]
    assert all(
        t.state.name == "COMPLETE" and t.values == [t.params["x"], -t.params["x"]] for t in study.trials
    )
    front = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())["solutions"]
    best = min(study.trials, key=lambda t: t.params["x"])  # min x and max -x: the smallest x dominates
    assert [s["number"] for s in front] == [best.number]


def test_directions_take_hydras_forms_and_refuse_anything_else():
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from hydra_plugins.distsync_optuna_sweeper._space import directions

    listed = OmegaConf.create({"direction": ["minimize", "maximize"]}).direction
    assert directions(listed) == ["minimize", "maximize"]
    assert directions("maximize") == ["maximize"]
    for wrong in ("maximise", ["minimize", "up"], []):
        with pytest.raises(ConfigCompositionException, match="hydra.sweeper.direction must be minimize or"):
            directions(wrong)


@pytest.mark.slow
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="two trials at once")
def test_the_readme_optuna_command_on_the_example_app_maximizes_what_it_reports(tmp_path):
    """The README's Optuna command, on a copy of examples/hydra_app (fewer trials): the app's own
    2-rank worlds, each trial reporting its held-out accuracy every 10 steps to the median pruner, and the
    best trial is the one of the highest accuracy, not the lowest."""
    import shutil

    app = tmp_path / "my_app"
    ignore = shutil.ignore_patterns("outputs", "multirun", "sweep")
    shutil.copytree(ROOT / "examples" / "hydra_app", app, ignore=ignore)
    readme = (ROOT / "README.md").read_text()
    (command,) = re.findall(r"python my_app\.py -m hydra/sweeper=distsync_optuna[^\n]*\\\n[^\n]*", readme)
    args = [a.strip("'") for a in command.replace("\\\n", " ").split()[3:]]
    assert "hydra.sweeper.direction=maximize" in args
    args = [a for a in args if not a.startswith("hydra.sweeper.n_trials=")]
    more = ["hydra.sweeper.n_trials=5", "hydra.sweeper.pruner.n_startup_trials=2", "hydra.sweep.dir=sweep"]
    proc = run_job([sys.executable, "app.py", "-m", *args, *more], cwd=app, timeout=600)
    assert proc.returncode == 0
    study = _study(f"journal:{app / 'sweep' / 'optuna_journal.log'}", "distsync")
    assert len(study.trials) == 5
    for trial in study.trials:
        job = Path(trial.user_attrs["job_dir"])
        assert json.loads((job / "rank0.json").read_text())["world_size"] == 2  # the app's own size
        steps = sorted(trial.intermediate_values)
        assert steps and steps == list(range(10, 10 * len(steps) + 1, 10)), trial  # every evaluation
        if trial.state.name == "PRUNED":
            assert yaml.safe_load((job / "trial.yaml").read_text())["pruned_at_step"] == steps[-1]
        else:
            assert trial.state.name == "COMPLETE" and steps[-1] == 40
    completed = [t for t in study.trials if t.state.name == "COMPLETE"]
    results = yaml.safe_load((app / "sweep" / "optimization_results.yaml").read_text())
    assert results["best_value"] == max(t.value for t in completed)


def test_a_result_the_study_cannot_take_is_said_and_fails_nothing(tmp_path, monkeypatch, capsys):
    """The record of a trial's value is a back-up of what the sweeper tells the study: a storage that cannot
    be reached (here a database file in a folder that does not exist) is said on stderr, and the job that
    recorded it, the packaged trainer or distsync.launch's rank 0, goes on."""
    from distsync import tuning

    monkeypatch.setenv(tuning.STORAGE, f"sqlite:///{tmp_path / 'missing' / 'study.db'}")
    monkeypatch.setenv(tuning.STUDY, "nowhere")
    monkeypatch.setenv(tuning.TRIAL, "0")
    tuning.report_result(0.5)
    assert "could not record the trial's result in its study" in capsys.readouterr().err


# ------------------------------------------------------------------------ slots through other launchers


def _slots_over(tmp_path: Path, run_one, n_trials: int, max_retries: int):
    """``_slots.Slots`` of two threads over a new study of ``x=interval(0,1)`` whose jobs are ``run_one``."""
    from optuna.distributions import FloatDistribution

    from distsync.tuning import storage_from_url
    from hydra_plugins.distsync_optuna_sweeper._slots import Slots
    from hydra_plugins.distsync_optuna_sweeper._trials import Trials

    url = f"journal:{tmp_path / 'journal.log'}"
    storage = storage_from_url(url)
    study = optuna.create_study(study_name="slots", storage=storage)
    space = {"x": FloatDistribution(0.0, 1.0)}
    trials = Trials(study, storage, url, {}, space, {}, tmp_path / "sweep", n_trials, "this-sweep", 60.0)
    return study, storage, Slots(trials, run_one, 2, max_retries)


def test_a_lost_job_is_launched_again_with_its_number_unless_its_world_recorded_its_outcome(tmp_path):
    """Through two slots (threads): trial #1's job is lost once (submitit's UncompletedJobError, as for a
    cancelled SLURM job) and launched again with the same number and parameters; #2's job is lost after its
    rank 0 recorded its value: told complete with it, not run again; #3's job is lost more often than
    max_retries allows: told failed; the other trials go on."""
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import UncompletedJobError

    from distsync import tuning

    calls: list[tuple[int, list[str]]] = []
    storage_box: list = []

    def run_one(number, overrides, stop, job):
        calls.append((number, list(overrides)))
        x = float(next(o for o in overrides if o.startswith("x=")).split("=", 1)[1])
        if number == 1 and sum(n == 1 for n, _ in calls) == 1:
            raise UncompletedJobError(f"Job 1{number} has not produced any output (state: CANCELLED)")
        if number == 2:
            trial_id = int(next(o for o in overrides if tuning.TRIAL in o).split("=", 1)[1].strip("'"))
            storage_box[0].set_trial_user_attr(trial_id, tuning.RESULT, [x + 10.0])
            raise UncompletedJobError("Job 12 has not produced any output (state: CANCELLED)")
        if number == 3:
            raise UncompletedJobError("Job 13 has not produced any output (state: NODE_FAIL)")
        return JobReturn(status=JobStatus.COMPLETED, _return_value=x)

    study, storage, slots = _slots_over(tmp_path, run_one, n_trials=5, max_retries=1)
    storage_box.append(storage)
    slots.run_threads()
    trials = {t.number: t for t in study.trials}
    assert [trials[n].state.name for n in range(5)] == [
        "COMPLETE",
        "COMPLETE",
        "COMPLETE",
        "FAIL",
        "COMPLETE",
    ]
    launched = [n for n, _ in calls]
    assert sorted(launched) == [0, 1, 1, 2, 3, 3, 4]  # #1 once more, #2 never again, #3 max_retries more
    runs_of_1 = [overrides for n, overrides in calls if n == 1]
    assert runs_of_1[0] == runs_of_1[1]  # the same parameters (and trial), so the same job dir
    assert trials[1].value == trials[1].params["x"]
    assert trials[2].value == pytest.approx(trials[2].params["x"] + 10.0)  # the recorded value
    (failed,) = [r for r in slots.trials.returns if r.status == JobStatus.FAILED]
    assert "NODE_FAIL" in str(failed._return_value)  # the sweep's error, if it ends failing, says why
    assert slots.trials.relaunched == {1: 1, 3: 1}


def test_a_sweeps_heartbeat_beats_while_it_runs_and_says_when_it_ended(tmp_path):
    """The sweep's heartbeat is written every interval while it runs (its trials' silence stays below the
    interval) and as 0 when it ends (its trials are silent for ever: the next sweep takes them over at
    once); a trial no distsync sweep runs has no heartbeat at all."""
    from distsync.tuning import storage_from_url
    from hydra_plugins.distsync_optuna_sweeper._heartbeat import OWNER, Heartbeat, silent_for

    storage = storage_from_url(f"journal:{tmp_path / 'journal.log'}")
    study = optuna.create_study(study_name="beats", storage=storage)
    study_id = storage.get_study_id_from_name("beats")
    ours, foreign = study.ask(), study.ask()
    with Heartbeat(storage, study_id, interval=0.1) as beat:
        ours.set_user_attr(OWNER, beat.sweep_id)
        time.sleep(0.5)
        frozen = {t.number: t for t in study.get_trials()}
        silent = silent_for(frozen[ours.number], storage.get_study_system_attrs(study_id), time.time())
        assert silent is not None and silent < 0.1 + 0.25 * timeout_scale()
    frozen = {t.number: t for t in study.get_trials()}
    beats = storage.get_study_system_attrs(study_id)
    assert silent_for(frozen[ours.number], beats, time.time()) == float("inf")
    assert silent_for(frozen[foreign.number], beats, time.time()) is None


def test_a_gone_sweeps_trial_is_taken_over_under_its_number_its_job_waited_for_then_launched_again(tmp_path):
    """A running trial whose sweep never wrote a heartbeat (gone) and whose job is recorded: the slots take
    it over first, under its own number and parameters, and are handed its job; that job ending without a
    result launches the trial again even with max_retries=0 (it was not this sweep's retry), and the study
    then asks new trials up to n_trials."""
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import UncompletedJobError

    from hydra_plugins.distsync_optuna_sweeper._heartbeat import OWNER
    from hydra_plugins.distsync_optuna_sweeper._trials import JOB

    calls: list[tuple[int, str | None]] = []

    def run_one(number, overrides, stop, job):
        calls.append((number, job))
        if job is not None:
            raise UncompletedJobError(f"Job {job} has not produced any output (state: CANCELLED)")
        x = float(next(o for o in overrides if o.startswith("x=")).split("=", 1)[1])
        return JobReturn(status=JobStatus.COMPLETED, _return_value=x)

    study, storage, slots = _slots_over(tmp_path, run_one, n_trials=2, max_retries=0)
    gone = study.ask({"x": optuna.distributions.FloatDistribution(0.0, 1.0)})
    gone.set_user_attr(OWNER, "a-killed-sweep")
    gone.set_user_attr(JOB, "slurm:4242")
    slots.run_threads()
    trials = {t.number: t for t in study.trials}
    assert [trials[n].state.name for n in range(2)] == ["COMPLETE", "COMPLETE"]
    assert [c for c in calls if c[0] == 0] == [(0, "slurm:4242"), (0, None)]
    assert trials[0].value == gone.params["x"] and trials[0].user_attrs[OWNER] == "this-sweep"


def test_while_trials_run_an_ignored_sigint_stops_the_sweep_and_an_apps_own_handler_stays():
    """An ignored SIGINT (a script's background command), which the submitted jobs would inherit, is
    KeyboardInterrupt while trials run and ignored again after; SIGTERM is SystemExit(143); an app's own
    SIGINT handler is left in place."""
    from hydra_plugins.distsync_optuna_sweeper._study import _stop_signals

    def own(signum, frame):
        pass

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        for handler, during in ((signal.SIG_IGN, signal.default_int_handler), (own, own)):
            signal.signal(signal.SIGINT, handler)
            with _stop_signals():
                assert signal.getsignal(signal.SIGINT) is during
                with pytest.raises(SystemExit) as stopped:
                    signal.raise_signal(signal.SIGTERM)
                assert stopped.value.code == 143
            assert signal.getsignal(signal.SIGINT) is handler
            assert signal.getsignal(signal.SIGTERM) is before[1]
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


class _WaitingJob:
    """A submitit job that never produces a result, and records its cancellation."""

    def __init__(self, folder: Path) -> None:
        self.job_id = "4242"
        self.paths = SimpleNamespace(result_pickle=folder / "never.pkl")
        self.cancelled = False

    def task(self, index: int) -> _WaitingJob:
        return self

    def done(self, force_check: bool = False) -> bool:
        return False

    def cancel(self, check: bool = True) -> None:
        self.cancelled = True


def test_a_stopping_sweep_cancels_the_job_of_a_slot_that_stopped_first(tmp_path):
    """SIGTERM or Ctrl-C stops the slots, then cancels the jobs they wait for: a slot that stops before
    the cancel (its wait wakes at once) leaves its job listed, so that job is cancelled too (before, the
    slot took it off the list first, and whichever thread ran first decided); a slot asked to run a trial
    once the sweep is stopping submits nothing."""
    from hydra_plugins.distsync_optuna_sweeper._slots import SubmititJobs, _Stopped

    launcher = SimpleNamespace(_EXECUTOR="local", params={"submitit_folder": str(tmp_path / ".submitit")})
    jobs = SubmititJobs(launcher, tmp_path / "sweep", lambda number, job: None)
    job, submitted = _WaitingJob(tmp_path), threading.Event()
    jobs.executor = SimpleNamespace(submit=lambda *args: submitted.set() or job)
    stop, outcome = threading.Event(), []

    def slot() -> None:
        try:
            jobs(0, ["x=0.5"], stop)
        except _Stopped:
            outcome.append("stopped")

    thread = threading.Thread(target=slot)
    thread.start()
    assert submitted.wait(30)
    stop.set()
    thread.join(30)  # the slot stops before the sweep cancels
    jobs.cancel_all()
    assert outcome == ["stopped"] and job.cancelled
    jobs.executor = SimpleNamespace(submit=lambda *args: pytest.fail("submitted while stopping"))
    with pytest.raises(_Stopped):
        jobs(1, ["x=0.1"], stop)


def _submitit_sweep(tmp_path: Path, *args: str) -> list[str]:
    return [
        sys.executable, str(APP), *SWEEPER, "hydra/launcher=submitit_local",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", *args,
    ]  # fmt: skip


def _submitted(sweep: Path, record: dict) -> float:
    """When submitit_local submitted the job that wrote ``record``."""
    job = record["ppid"]  # submitit's local controller, which runs the trial as its child
    return (sweep / ".submitit" / str(job) / f"{job}_submitted.pkl").stat().st_mtime


@pytest.mark.slow
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="two trials at once")
def test_through_submitit_a_trial_starts_as_soon_as_a_slot_frees(tmp_path):
    """Hydra's submitit launcher (submitit_local here; submitit_slurm in test_slurm.py), n_jobs=2: trials of
    unequal length (one step or 25 s), each a job of its own. When a trial ends while the trial in the other
    slot (submitted before that end) runs on, the next trial is submitted before that other trial ends: in
    batches it never is. Submitted: the mtime of submitit's ``<job>_submitted.pkl`` (a local job's id is
    the pid of the controller that runs the trial). Told from submissions and ends only, with no margin of
    seconds: at a load of 10 on 2 cores (the whole suite with -n 4) a job took up to 100 s to start, so a
    long trial could start after a short one had ended, and the driver could take 20 s to notice an end;
    at least one such case must show it (every case does on a machine that is not overloaded)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    command = _submitit_sweep(
        tmp_path, "hydra.sweeper.n_trials=6", "hydra.sweeper.n_jobs=2", "hydra.sweeper.sampler.seed=0",
        "steps=choice(1,50)", "step_seconds=0.5", "x=interval(0,1)",
    )  # fmt: skip
    proc = run_job(command, tmp_path, timeout=400, PYTHONPATH=_vision.python_path())
    assert proc.returncode == 0
    records = sorted(_records(tmp_path / "sweep"), key=lambda r: r["start"])
    assert len(records) == 6
    submitted = [_submitted(tmp_path / "sweep", r) for r in records]
    trials = list(zip(submitted, (r["end"] for r in records), strict=True))
    cases = []  # (when a trial ended, when the next was submitted, when the other slot's trial ended)
    for ended_at in (end for _, end in trials):
        later = [sub for sub, _ in trials if sub > ended_at]
        running = [end for sub, end in trials if sub < ended_at < end]  # the other slot's trial runs on
        if later and running:
            cases.append((ended_at, min(later), max(running)))
    assert cases, (records, submitted)  # the seed draws short and long trials side by side
    assert any(next_submitted < other_end for _, next_submitted, other_end in cases), (cases, records)


@pytest.mark.slow
def test_through_submitit_a_trial_whose_job_is_killed_goes_on_in_its_job_dir(tmp_path):
    """A trial's job killed mid-trial (SIGKILL: no result, as for a cancelled or preempted SLURM job) is
    launched again with its number, so in its job dir, where it goes on from its last saved step; the study
    ends with every trial complete and the sweep exits 0."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    command = _submitit_sweep(
        tmp_path, "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2", "x=interval(0,1)", "steps=16",
        "step_seconds=0.5", "checkpoint=true",
    )  # fmt: skip
    env = job_env(PYTHONPATH=_vision.python_path())
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    driver = subprocess.Popen(command, cwd=tmp_path, env=env, start_new_session=True, **output)
    saved = sweep / "1" / "step0.txt"
    _wait_for(lambda: saved.exists() and int(saved.read_text() or -1) >= 3, "trial #1 to pass step 3")
    (start,) = _runs(sweep / "1")
    os.kill(start["pid"], signal.SIGKILL)
    killed_after = int(saved.read_text())
    output, _ = driver.communicate(timeout=300 * timeout_scale())
    assert driver.returncode == 0, output[-4000:]
    runs = _runs(sweep / "1")
    assert [r["first_step"] for r in runs] == [0, killed_after + 1], output[-4000:]  # went on, not over
    trials = _trials(f"journal:{sweep / 'optuna_journal.log'}", "distsync")
    assert [t.state.name for t in trials.values()] == ["COMPLETE"] * 3
    assert yaml.safe_load((sweep / "1" / "trial.yaml").read_text())["relaunched"] == 1
    assert "trial #1: its job ended without a result" in output
    _check_job_dirs(sweep, trials)


@pytest.mark.slow
def test_sigterm_to_a_submitit_sweep_cancels_its_jobs_and_the_same_command_resumes_them(tmp_path):
    """SIGTERM to the sweep, as Ctrl-C: the jobs it submitted are cancelled (their processes end), their
    trials stay running, marked interrupted, and the sweep exits 143; the same command resumes each under its
    number in its job dir from its last saved step: every trial finished once, the sweep exits 0.

    The sweep starts as a script's background command does, with SIGINT ignored, which its jobs would
    inherit: submitit cancels a local job with SIGINT, so they would train on."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    args = ["hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2", "x=interval(0,1)", "step_seconds=0.5"]
    command = _submitit_sweep(tmp_path, *args, "checkpoint=true", UNTIL_STOPPED)
    in_the_background = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]  # `command &` in a script
    env = job_env(PYTHONPATH=_vision.python_path())
    # To a file, not a pipe: submitit's local job controllers inherit the sweep's stdout, so a pipe would stay
    # open while a job that was not cancelled runs on, and hide the sweep's own output.
    log = tmp_path / "driver.log"
    with log.open("w") as output:
        driver = subprocess.Popen(
            in_the_background + command, cwd=tmp_path, env=env, start_new_session=True, stdout=output,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    _wait_for(lambda: len(list(sweep.glob("*/step0.txt"))) == 2, "two trials' first steps")
    pids = [json.loads(p.read_text().splitlines()[0])["pid"] for p in sweep.glob("*/started0.jsonl")]
    driver.send_signal(signal.SIGTERM)
    driver.wait(timeout=120 * timeout_scale())
    output = log.read_text()
    assert driver.returncode == 143, output[-4000:]
    _wait_for(lambda: not any(_alive(pid) for pid in pids), f"the cancelled jobs to end:\n{output}", 60)
    trials = _trials(f"journal:{sweep / 'optuna_journal.log'}", "distsync")
    assert [(t.state.name, t.user_attrs.get("distsync_interrupted")) for t in trials.values()] == [
        ("RUNNING", True), ("RUNNING", True),
    ]  # fmt: skip
    assert "cancelling job" in output
    stopped_at = {n: int((sweep / str(n) / "step0.txt").read_text()) for n in (0, 1)}

    proc = run_job(_submitit_sweep(tmp_path, *args, "checkpoint=true", "steps=8"), tmp_path, timeout=300,
                   PYTHONPATH=_vision.python_path())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trials = _trials(f"journal:{sweep / 'optuna_journal.log'}", "distsync")
    assert [t.state.name for t in trials.values()] == ["COMPLETE"] * 3
    for n in (0, 1):
        runs = _runs(sweep / str(n))
        assert [r["first_step"] for r in runs] == [0, stopped_at[n] + 1], n
    _check_job_dirs(sweep, trials)


@pytest.mark.slow
def test_a_killed_submitit_sweeps_running_job_is_waited_for_and_its_result_taken(tmp_path):
    """SIGKILL to a submitit sweep while a trial's job runs: the job runs on (it is not the sweep's
    process). The same command, run again, takes the trial over and waits for that job rather than
    starting another in its job dir: the trial ran once, from step 0 to its end, and its result is told."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    args = ["hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1", "hydra.sweeper.heartbeat_interval=1",
            "x=interval(0,1)", "step_seconds=0.5", "steps=16", "checkpoint=true"]  # fmt: skip
    env = job_env(PYTHONPATH=_vision.python_path())
    driver = subprocess.Popen(_submitit_sweep(tmp_path, *args), cwd=tmp_path, env=env, start_new_session=True)
    saved = sweep / "0" / "step0.txt"
    _wait_for(lambda: saved.exists() and int(saved.read_text() or -1) >= 2, "trial #0's step 2")
    driver.send_signal(signal.SIGKILL)
    driver.wait(60)
    (run,) = _runs(sweep / "0")
    assert _alive(run["pid"])  # the job runs on without its sweep
    proc = run_job(_submitit_sweep(tmp_path, *args), tmp_path, timeout=300, PYTHONPATH=_vision.python_path())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trials = _trials(f"journal:{sweep / 'optuna_journal.log'}", "distsync")
    assert [t.state.name for t in trials.values()] == ["COMPLETE"] * 2
    runs = _runs(sweep / "0")
    assert [r["first_step"] for r in runs] == [0]  # the one run, waited for: nothing computed twice
    assert trials[0].value == json.loads((sweep / "0" / "rank0.json").read_text())["x"]
    assert "UpdateFinishedTrialError" not in proc.stdout + proc.stderr
    _check_job_dirs(sweep, trials)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
