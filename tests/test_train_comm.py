"""DDP communication options (compression hooks, PowerSGD, post-local-SGD) still train to a good model."""

from __future__ import annotations

import pytest

from distsync.train import DataConfig, TrainConfig, TrainerConfig
from distsync.train.launcher import launch


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"comm_hook": "fp16"},
        {"comm_hook": "powersgd", "powersgd_rank": 2},
        {"local_sgd_period": 4, "local_sgd_warmup": 10},
    ],
    ids=["fp16", "powersgd", "post-local-sgd"],
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
    key = "comm_hook" if "comm_hook" in options else "local_sgd_period"
    assert summary[key] == options[key]
