"""Ray Train, run as a user runs it on 2 CPU workers of a local Ray cluster: the recipe of docs/your_app.md
(examples/recipes/ray_train.py), and an out-of-step worker under prepare_model's defaults; skipped where
ray[train] is not installed."""

from __future__ import annotations

import json
import sys

import pytest
from launching import ROOT, run_job

pytest.importorskip("ray.train.torch", reason="ray[train] is not installed")


@pytest.mark.slow
def test_ray_train_recipe_trains_with_synchronized_statistics(tmp_path):
    report = tmp_path / "report"
    command = [
        sys.executable, str(ROOT / "examples" / "recipes" / "ray_train.py"),
        "--storage", str(tmp_path / "ray_results"), "--report", str(report),
    ]  # fmt: skip
    proc = run_job(command, tmp_path, timeout=300, RAY_ADDRESS="local", RAY_USAGE_STATS_ENABLED="0")
    assert proc.returncode == 0
    assert "data-parallel wrapper" not in proc.stderr + proc.stdout
    ranks = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    assert ranks[0]["type"] == "DistSyncBatchNorm2d"
    assert ranks[0]["weight"] == ranks[1]["weight"]  # gradients averaged
    assert ranks[0]["running_mean"] == ranks[1]["running_mean"]  # statistics synchronized, not broadcast
    assert any(abs(w - 1.0) > 1e-4 for w in ranks[0]["weight"])  # and it trained


_OUT_OF_STEP = """
import json, sys
import ray.train, ray.train.torch, torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch import nn
import distsync

def train_loop(config):
    torch.manual_seed(0)
    model = distsync.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    model = ray.train.torch.prepare_model(model)  # Ray's defaults: DDP broadcasts buffers before each forward
    rank = ray.train.get_context().get_world_rank()
    try:
        for step in range(3):
            model(torch.randn(2 + rank, 3, 4, 4)).square().sum().backward()
            if rank == 0 and step == 1:
                model.module[1](torch.randn(3, 4, 2, 2))  # one synchronized call more than rank 1
        outcome = "no error"
    except Exception as error:
        outcome = type(error).__name__ + ": " + str(error).splitlines()[0]
    with open(f"{config['report']}.{rank}", "w") as file:
        json.dump(outcome, file)

TorchTrainer(
    train_loop,
    train_loop_config={"report": sys.argv[2]},
    scaling_config=ScalingConfig(num_workers=2),
    torch_config=TorchConfig(timeout_s=60),  # a hang would fail in a minute, not 30
    run_config=RunConfig(storage_path=sys.argv[1], name="out-of-step"),
).fit()
"""


@pytest.mark.slow
def test_an_out_of_step_rank_raises_on_every_worker_under_prepare_model_defaults(tmp_path):
    """prepare_model wraps in DDP with broadcast_buffers=True: its broadcast must not pair with the extra
    call's all-reduce on the other rank (a hang until the timeout); both workers raise SyncMismatchError."""
    script, report = tmp_path / "out_of_step.py", tmp_path / "report"
    script.write_text(_OUT_OF_STEP)
    command = [sys.executable, str(script), str(tmp_path / "ray_results"), str(report)]
    proc = run_job(command, tmp_path, timeout=300, RAY_ADDRESS="local", RAY_USAGE_STATS_ENABLED="0")
    assert proc.returncode == 0
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"report.{rank}").read_text())
        assert outcome.startswith("SyncMismatchError"), outcome
