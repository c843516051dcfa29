"""DDP communication options (compression hooks, PowerSGD, post-local-SGD) still train to a good model."""

from __future__ import annotations

import json

import pytest

from distsync.train import DataConfig, TrainConfig, TrainerConfig
from distsync.train.hydra_app import launch


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"comm_hook": "fp16"},
        {"comm_hook": "powersgd", "powersgd_rank": 2},
    ],
    ids=["fp16", "powersgd"],  # post-local SGD trains in test_post_local_sgd_resume_...
)
def test_training_converges(tmp_path, options):
    trainer = TrainerConfig(
        max_steps=60,
        max_restarts=0,
        log_every=20,
        eval_every=60,
        checkpoint_every=60,
        monitor_interval=0.2,
        **options,
    )
    cfg = TrainConfig(data=DataConfig(batch_size=32), trainer=trainer)
    summary = launch(cfg, str(tmp_path))
    assert summary["world_size"] == 2 and summary["steps"] == 60
    assert summary["accuracy"] > 0.9, summary
    assert summary["final_loss"] < 0.5
    assert summary["bn_buffers_in_sync"] is True
    assert summary["comm_hook"] == options["comm_hook"]


def _train_losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.mark.slow
def test_post_local_sgd_resume_reproduces_the_uninterrupted_losses(tmp_path, monkeypatch):
    """Between averagings every rank has its own model and momentum: a checkpoint must hold all of them."""
    trainer = TrainerConfig(
        max_steps=40,
        max_restarts=1,
        log_every=5,
        eval_every=40,
        checkpoint_every=20,  # not an averaging step: the ranks' models differ there
        monitor_interval=0.2,
        local_sgd_period=4,
        local_sgd_warmup=10,
    )
    cfg = TrainConfig(data=DataConfig(batch_size=32), trainer=trainer)
    straight = launch(cfg, str(tmp_path / "straight"))
    assert straight["accuracy"] > 0.9 and straight["final_loss"] < 0.5, straight  # it trains
    assert straight["bn_buffers_in_sync"] is True and straight["local_sgd_period"] == 4
    monkeypatch.setenv("DISTSYNC_TEST_KILL_AT_STEP", "25")
    resumed = launch(cfg, str(tmp_path / "resumed"))
    assert straight["restarts"] == 0 and resumed["restarts"] == 1 and resumed["resumed_from_step"] == 20
    assert _train_losses(tmp_path / "resumed") == _train_losses(tmp_path / "straight")
    assert resumed["final_loss"] == straight["final_loss"] and resumed["accuracy"] == straight["accuracy"]


@pytest.mark.slow
def test_precise_bn_changes_the_statistics_and_nothing_else(tmp_path):
    """trainer.precise_bn_batches: before each evaluation the synced layers' statistics are recomputed
    (distsync.update_bn) on batches drawn apart from the training order, so training is unchanged."""
    import torch

    models = {}
    for batches in (0, 4):
        trainer = TrainerConfig(
            max_steps=20, max_restarts=0, log_every=10, eval_every=10, checkpoint_every=20,
            monitor_interval=0.2, precise_bn_batches=batches,
        )  # fmt: skip
        run_dir = tmp_path / f"precise{batches}"
        summary = launch(TrainConfig(data=DataConfig(batch_size=16), trainer=trainer), str(run_dir))
        assert summary["bn_buffers_in_sync"] is True and summary["steps"] == 20
        models[batches] = torch.load(run_dir / "model_inference.pt", weights_only=False).state_dict()
    plain, precise = models[0], models[4]
    for key, value in plain.items():
        if "running_" in key:
            assert not torch.allclose(value, precise[key]), key  # recomputed
        else:  # parameters and num_batches_tracked: the same training
            torch.testing.assert_close(value, precise[key], rtol=0, atol=0, msg=key)
