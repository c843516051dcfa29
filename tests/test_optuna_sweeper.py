"""hydra/sweeper=distsync_optuna: Hydra's Optuna sweeper's configs on current Optuna, trials that never wait
for a batch, pruning that stops every rank of a trial's world together, failures, and resuming."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import _vision
import pytest
import yaml
from launching import ROOT, job_env, run_job

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

    from hydra_plugins.distsync_optuna_sweeper._study import search_space

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


@pytest.mark.slow
def test_a_killed_sweep_resumes_from_its_storage(tmp_path):
    storage = f"journal:{tmp_path / 'journal.log'}"
    args = [
        f"hydra.sweeper.storage='{storage}'", "hydra.sweeper.study_name=resumed", "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=1", "x=interval(0,1)", "steps=6", "step_seconds=0.5",
    ]  # fmt: skip
    command = [sys.executable, str(APP), *SWEEPER, f"hydra.sweep.dir={tmp_path / 'first'}", *args]
    first = subprocess.Popen(command, cwd=tmp_path, env=job_env(PYTHONPATH=_vision.python_path()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((tmp_path / "first").glob("*/rank0.json"))) < 1:
        time.sleep(0.2)
    time.sleep(1.0)  # the second trial is running
    first.send_signal(signal.SIGKILL)
    first.wait(60)
    done = [t for t in _study(storage, "resumed").trials if t.state.name == "COMPLETE"]
    assert len(done) >= 1
    proc = _sweep(tmp_path, *args, cwd=tmp_path)
    assert proc.returncode == 0
    trials = _study(storage, "resumed").trials
    counted = [t for t in trials if not t.user_attrs.get("distsync_interrupted")]
    assert len([t for t in counted if t.state.name == "COMPLETE"]) == 4
    assert all(t.state.name == "FAIL" for t in trials if t.user_attrs.get("distsync_interrupted"))
    assert len(list((tmp_path / "sweep").glob("*/rank0.json"))) == 4 - len(done)
