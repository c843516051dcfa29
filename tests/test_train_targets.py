"""The training job's ``_target_`` nodes and launch-template options: your own model, data and optimizer."""

from __future__ import annotations

import os
import sys

import _vision
import pytest
import torch
from launching import FAST, SCRIPT, run_job, unexpected_keyword
from launching import summary as read_summary
from torch.utils.data import TensorDataset

import distsync
from distsync.train import DataConfig, ModelConfig, OptimConfig, TrainConfig, TrainerConfig
from distsync.train.data import LoaderBatches
from distsync.train.hydra_app import launch
from distsync.train.targets import instantiate


def test_instantiate_builds_nested_nodes_first():
    linear = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}
    relu = {"_target_": "torch.nn.ReLU"}
    built = instantiate({"_target_": "torch.nn.ModuleList", "modules": [relu, linear]})
    assert isinstance(built[0], torch.nn.ReLU) and built[1].out_features == 3


def test_loader_batches_resume_mid_epoch_with_the_same_batches():
    dataset = TensorDataset(torch.arange(40.0).unsqueeze(1), torch.arange(40))
    straight = iter(LoaderBatches(dataset, 4, rank=1, world_size=2, seed=3))
    expected = [next(straight)[1].tolist() for _ in range(8)]  # 5 batches per epoch: crosses an epoch
    first = LoaderBatches(dataset, 4, rank=1, world_size=2, seed=3)
    it = iter(first)
    seen = [next(it)[1].tolist() for _ in range(3)]
    resumed = LoaderBatches(dataset, 4, rank=1, world_size=2, seed=3)
    resumed.load_state_dict(first.state_dict())
    it = iter(resumed)
    seen += [next(it)[1].tolist() for _ in range(5)]
    assert seen == expected


@pytest.mark.slow
def test_your_own_model_with_accumulation_clipping_bf16_and_channels_last(tmp_path):
    cfg = TrainConfig(
        model=ModelConfig(name="mine", factory={"_target_": "train_fixtures.make_net", "width": 8}),
        data=DataConfig(name="synthetic", batch_size=8, num_samples=400),
        optim=OptimConfig(factory={"_target_": "torch.optim.Adam"}, lr=0.01),
        trainer=TrainerConfig(
            max_steps=6,
            checkpoint_every=6,
            eval_every=6,
            log_every=3,
            grad_accum_steps=2,
            grad_clip=1.0,
            precision="bf16",
            channels_last=True,
            progress=False,
        ),
    )
    summary = launch(cfg, str(tmp_path))
    assert summary["steps"] == 6 and summary["model"] == "mine"
    assert 0.0 <= summary["accuracy"] <= summary["accuracy_top5"] <= 1.0  # 10 classes: top-5 reported
    state = torch.load(sorted((tmp_path / "checkpoints").glob("*.pt"))[-1], weights_only=False)
    assert state["batches"] == {"epoch": 0, "batch": 12}  # two micro-batches a step
    assert state["optimizer"]["state"] and "betas" in state["optimizer"]["param_groups"][0]  # Adam

    inference = torch.load(tmp_path / "model_inference.pt", weights_only=False)
    assert not any(isinstance(m, distsync.DistSyncBatchNorm) for m in inference.modules())
    assert isinstance(inference[1], torch.nn.BatchNorm2d) and not inference.training
    assert torch.equal(inference[1].running_mean, state["model"]["1.running_mean"])


def test_a_misspelled_command_line_argument_fails_in_one_line(tmp_path):
    """(A factory trains from the command line in test_resnet18_on_fake_data: model=resnet18 is one.)"""
    common = [sys.executable, str(SCRIPT), *FAST, "trainer.max_steps=4", "data.batch_size=8"]
    bad = run_job(
        [
            *common,
            f"hydra.run.dir={tmp_path / 'bad'}",
            "+model.factory._target_=torch.nn.Linear",
            "+model.factory.in_feature=3",
        ],
        cwd=tmp_path,
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "Error: model.factory (torch.nn.Linear): TypeError: "
        + unexpected_keyword("Linear.__init__", "in_feature", "in_features")
    ]
    assert not (tmp_path / "bad").exists()  # the run directory Hydra made for this job alone, removed


def test_resnet18_on_fake_data(tmp_path):
    pytest.importorskip("torchvision", exc_type=ImportError)
    proc = run_job(
        [
            sys.executable,
            str(SCRIPT),
            "model=resnet18",
            "data=fake",
            "trainer.max_steps=4",
            *FAST,
            "data.image_size=16",
            "data.train.size=64",
            "data.test.size=32",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=tmp_path,
        timeout=300,
        PYTHONPATH=_vision.python_path(),  # every process of the job imports torchvision like the tests
    )
    assert proc.returncode == 0
    # data.num_workers unset: one fewer than the cores per rank (2 ranks here), at most 8
    assert read_summary(tmp_path)["loader_workers"] == min(8, max(0, os.cpu_count() // 2 - 1))
