"""The training job on a streaming dataset whose per-rank shards are uneven: passes under DDP's Join."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import uneven_stream
from launching import FAST, SCRIPT, metric_steps, run_job, summary

from distsync.testing import run_world
from distsync.train import ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig, TrainerConfig, run
from distsync.train.build import check_buildable
from distsync.train.checkpoint import checkpoint_dir

BATCH, SHARDS = 4, [3, 2]  # rank 0 has 3 batches per pass, rank 1 has 2


def _cfg(max_steps: int, shards: list[int] = SHARDS, net: str = "make_net", **trainer) -> TrainConfig:
    stream = {"_target_": "uneven_stream.UnevenStream", "batches": shards, "batch_size": BATCH}
    defaults = dict(max_steps=max_steps, log_every=2, eval_every=4, checkpoint_every=4, progress=False)
    return TrainConfig(
        model=ModelConfig(factory={"_target_": f"uneven_stream.{net}"}),
        data=DataConfig(
            batch_size=BATCH, num_classes=uneven_stream.CLASSES, train=stream,
            test={"_target_": "uneven_stream.held_out"},
        ),
        optim=OptimConfig(schedule="constant", lr=0.05),
        trainer=TrainerConfig(**(defaults | trainer)),
    )  # fmt: skip


def _train(rank, world_size, max_steps, run_dir, net="make_net"):
    return run(_cfg(max_steps, net=net), run_dir)


def _reference_input_bn(steps: int) -> dict[str, torch.Tensor]:
    """float64 nn.BatchNorm2d's running statistics over the global batch of each step: the batches that
    exist that step (rank 1 has none at step 3 of each pass)."""
    bn = torch.nn.BatchNorm2d(1, dtype=torch.float64)
    data = {r: uneven_stream.samples(r, 0, n * BATCH)[0] for r, n in enumerate(SHARDS)}
    for step in range(steps):
        ranks = [r for r, n in enumerate(SHARDS) if step < n]
        bn(torch.cat([data[r][step * BATCH : (step + 1) * BATCH] for r in ranks]))
    return {f"0.{k}": v for k, v in bn.state_dict().items() if "running" in k or "tracked" in k}


def _train_without_data_on_rank_1(rank, world_size, run_dir):
    return run(_cfg(2, shards=[2, 0]), run_dir)


def test_a_rank_without_any_batch_shadows_the_others(tmp_path):
    """Rank 1's shard is empty: it joins at once and takes part in rank 0's synchronized calls, so the input
    layer's running statistics are float64 nn.BatchNorm2d's over rank 0's batches, on both ranks."""
    summaries = run_world(_train_without_data_on_rank_1, 2, str(tmp_path), timeout=150)
    assert summaries[0]["steps"] == 2 and summaries[0]["bn_buffers_in_sync"] is True
    bn = torch.nn.BatchNorm2d(1, dtype=torch.float64)
    images = uneven_stream.samples(0, 0, 2 * BATCH)[0]
    for step in range(2):
        bn(images[step * BATCH : (step + 1) * BATCH])
    model = torch.load(sorted(checkpoint_dir(tmp_path).glob("*.pt"))[-1], weights_only=False)["model"]
    for key, want in bn.state_dict().items():
        if "running" in key or "tracked" in key:
            torch.testing.assert_close(model[f"0.{key}"].to(want.dtype), want, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.parametrize("net", ["make_net", "make_checkpointed_net"])
def test_one_pass_of_uneven_shards_matches_float64_batchnorm(tmp_path, net):
    """With a checkpointed model too: the joined rank takes part in the calls, not in the recomputations."""
    summaries = run_world(_train, 2, 3, str(tmp_path), net, timeout=150)
    assert summaries[0]["steps"] == 3 and summaries[0]["bn_buffers_in_sync"] is True
    timing = ("wall_seconds", "attempt_wall_seconds")
    assert [{k: v for k, v in s.items() if k not in timing} for s in summaries] == [
        {k: v for k, v in summaries[0].items() if k not in timing}
    ] * 2
    model = torch.load(sorted(checkpoint_dir(tmp_path).glob("*.pt"))[-1], weights_only=False)["model"]
    for key, want in _reference_input_bn(3).items():
        torch.testing.assert_close(model[key].to(want.dtype), want, rtol=1e-6, atol=1e-6, msg=key)


def test_passes_until_max_steps_with_logs_at_pass_boundaries(tmp_path):
    """Passes of 3 steps: logs due at 2, 4, 6 come at 3 and 6, the end at 7 (in the third pass)."""
    first = run_world(_train, 2, 7, str(tmp_path / "run"), timeout=150)
    assert {s["steps"] for s in first} == {7} and first[0]["bn_buffers_in_sync"] is True
    assert metric_steps(tmp_path / "run", "train") == [3, 6, 7]
    assert metric_steps(tmp_path / "run", "eval") == [6, 7]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if r["kind"] == "train"] == [1, 2, 3]


def test_streaming_settings_are_refused_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"^trainer.grad_accum_steps: must be 1 with a streaming"):
        check_buildable(_cfg(4, grad_accum_steps=2), world_size=2)


@pytest.mark.slow
def test_packaged_command_on_uneven_shards(tmp_path):
    stream = ["+data.train._target_=uneven_stream.UnevenStream", f"+data.train.batches={SHARDS}",
              f"+data.train.batch_size={BATCH}", "+data.test._target_=uneven_stream.held_out",
              "+model.factory._target_=uneven_stream.make_net"]  # fmt: skip
    proc = run_job(
        [sys.executable, str(SCRIPT), *FAST, *stream, f"data.batch_size={BATCH}", "data.num_classes=3",
         "trainer.max_steps=8", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, PYTHONPATH=str(SCRIPT.parents[1] / "tests"),
    )  # fmt: skip
    assert proc.returncode == 0
    s = summary(tmp_path)
    assert s["steps"] == 8 and s["bn_buffers_in_sync"] is True and s["world_size"] == 2
    assert metric_steps(tmp_path, "train") == [6, 8]  # log_every=5: due at 5, logged at the boundary 6
