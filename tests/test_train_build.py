"""Config errors of the training job's pieces: one line before any worker starts, never a restart."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launching import FAST, SCRIPT, job_env, run_job, unexpected_keyword

import distsync
from distsync.launching.elastic import NonRetryableError
from distsync.train import DataConfig, ModelConfig, OptimConfig, TrainConfig, TrainerConfig
from distsync.train.build import check_buildable
from distsync.train.config import ConfigError
from distsync.train.hydra_app import launch


def _cfg(factory: dict | None = None, data: dict | None = None, optim: dict | None = None, **trainer):
    return TrainConfig(
        model=ModelConfig(factory=factory or {}),
        data=DataConfig(**({"batch_size": 8} | (data or {}))),
        optim=OptimConfig(**(optim or {})),
        trainer=TrainerConfig(**({"max_steps": 4, "progress": False, "monitor_interval": 0.1} | trainer)),
    )


def _dataset(size: int) -> dict:
    return {"_target_": "train_fixtures.tensor_dataset", "size": size}


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            _cfg({"_target_": "train_fixtures.broken_net"}),
            "model.factory (train_fixtures.broken_net): ValueError: no such weights: imagenet-22k",
        ),
        (  # passes the signature check (**kwargs), fails when called
            _cfg({"_target_": "train_fixtures.make_net_from_kwargs", "num_clases": 10}),
            "model.factory (train_fixtures.make_net_from_kwargs): TypeError: "
            + unexpected_keyword("_KeywordNet.__init__", "num_clases", "num_classes"),
        ),
        (
            _cfg(data={"train": _dataset(30), "test": _dataset(8), "batch_size": 16}),
            "data.batch_size must be at most 15 with 2 ranks (30 training samples) (got 16)",
        ),
        (
            _cfg(optim={"factory": {"_target_": "torch.optim.SGD", "momentum": -1.0}}),
            "optim.factory (torch.optim.SGD): ValueError: Invalid momentum value: -1.0",
        ),
        (  # the built-in optimizer, built for the schedule's sake
            _cfg(optim={"scheduler": {"_target_": "torch.optim.lr_scheduler.StepLR"}}),
            "optim.scheduler (torch.optim.lr_scheduler.StepLR): TypeError: StepLR.__init__() missing 1 "
            "required positional argument: 'step_size'",
        ),
    ],
    ids=["factory-raises", "misspelled-kwarg", "batch-too-large", "optimizer-rejects", "scheduler-rejects"],
)
def test_a_piece_that_cannot_be_built_is_named_before_any_worker_starts(cfg, message):
    with pytest.raises(ConfigError) as error:
        check_buildable(cfg, world_size=2)
    assert str(error.value) == message


def test_the_check_builds_the_model_on_meta_and_passes_a_good_config():
    cfg = _cfg({"_target_": "train_fixtures.make_net_from_kwargs", "width": 4}, data={"batch_size": 15})
    cfg.data.train, cfg.data.test = _dataset(30), _dataset(8)
    check_buildable(cfg, world_size=2)  # no error: 15 samples per rank


def test_checking_the_built_in_optimizer_leaves_dynamo_to_the_workers():
    """Building a torch optimizer imports torch._dynamo (about 1.5 s of CPU before any worker could start);
    the built-in optimizer and schedule take only values the config checked, so the launching process
    builds neither (the workers' fork server imports dynamo once for them, see test_elastic)."""
    code = (
        "import sys\nfrom distsync.train import TrainConfig\n"
        "from distsync.train.build import check_buildable\n"
        "check_buildable(TrainConfig(), 2)\nprint('torch._dynamo' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]


def test_a_config_error_only_the_workers_see_is_not_restarted(tmp_path, monkeypatch, capsys):
    calls = tmp_path / "calls"
    calls.mkdir()
    monkeypatch.setenv("DISTSYNC_TEST_CALLS_DIR", str(calls))
    cfg = _cfg({"_target_": "train_fixtures.net_broken_in_workers"}, max_restarts=3)
    started = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        launch(cfg, str(tmp_path / "run"))
    assert stop.value.code == 1
    assert len(list(calls.iterdir())) == 2  # one start per rank: the world was not restarted
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "Error: training failed: model.factory (train_fixtures.net_broken_in_workers): "
        "ValueError: broken in every worker"
    )
    assert time.monotonic() - started < 60  # three restarts took ~20 s; a hang would take 300


def test_a_failure_on_some_ranks_only_stays_an_ordinary_failure(tmp_path):
    cfg = _cfg({"_target_": "train_fixtures.net_broken_on_rank_1"})
    run = functools.partial(distsync.train.rank_process.run, run_dir=str(tmp_path))
    with pytest.raises(distsync.LaunchError) as error:
        distsync.launch(run, cfg, nproc_per_node=2, max_restarts=0)
    assert "rank(s) 1 could not build the job: model.factory" in str(error.value)
    assert not isinstance(error.value.__cause__, NonRetryableError)


def test_launch_does_not_restart_for_a_non_retryable_error(tmp_path):
    script = tmp_path / "app.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, pathlib, sys
            import distsync

            def main(calls):
                pathlib.Path(calls, str(os.getpid())).touch()
                raise distsync.NonRetryableError("bad config: lr=-1")

            if __name__ == "__main__":
                try:
                    distsync.launch(main, sys.argv[1], nproc_per_node=2, max_restarts=3)
                except distsync.LaunchError as error:
                    print("LaunchError", error, set(error.failures) <= {0, 1} and bool(error.failures))
            """
        )
    )
    calls = tmp_path / "calls"
    calls.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script), str(calls)], env=job_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip() == "LaunchError bad config: lr=-1 True"
    assert 1 <= len(list(calls.iterdir())) <= 2  # a restart would start two more (one per rank)
    assert proc.stderr.strip() == ""  # nothing about restarting, closing workers, or tracebacks


def test_the_command_line_says_it_in_one_line_and_leaves_no_run_directory(tmp_path):
    proc = run_job(
        [
            sys.executable,
            str(SCRIPT),
            *FAST,
            f"hydra.run.dir={tmp_path / 'run'}",
            "+model.factory._target_=train_fixtures.make_net_from_kwargs",
            "+model.factory.num_clases=10",
            "trainer.max_restarts=3",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "Error: model.factory (train_fixtures.make_net_from_kwargs): TypeError: "
        + unexpected_keyword("_KeywordNet.__init__", "num_clases", "num_classes")
    ]
    assert not (tmp_path / "run").exists()


def test_distsync_train_imports_targets_from_the_current_directory(tmp_path):
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("def make_net(**kw):\n    raise ValueError('my_pkg was imported')\n")
    train = Path(sys.executable).with_name("distsync-train")  # the console script pip installed
    proc = run_job([str(train), "+model.factory._target_=my_pkg.make_net"], cwd=tmp_path)
    assert proc.stderr.strip() == "Error: model.factory (my_pkg.make_net): ValueError: my_pkg was imported"


def test_a_target_whose_module_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_models.py").write_text("raise RuntimeError('operator x::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg({"_target_": "broken_models.resnet18"})
    with pytest.raises(ConfigError) as error:
        check_buildable(cfg, world_size=2)
    assert str(error.value) == (
        "model.factory (broken_models.resnet18): ImportError: Error loading 'broken_models.resnet18': "
        "RuntimeError('operator x::nms does not exist')"
    )


def test_an_unimportable_target_is_one_line():
    with pytest.raises(ConfigError) as error:
        check_buildable(_cfg({"_target_": "no_such_package.make_model"}), world_size=2)
    assert str(error.value) == (
        "model.factory (no_such_package.make_model): ImportError: "
        "Error loading 'no_such_package.make_model': "
        "ModuleNotFoundError(\"No module named 'no_such_package'\")"
    )
