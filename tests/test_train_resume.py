"""Resuming a run directory: which config changes are refused, and what a resume reproduces."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from distsync.train import DataConfig, ModelConfig, OptimConfig, TrainConfig, TrainerConfig, run
from distsync.train.checkpoint import checkpoint_dir
from distsync.train.resume import ResumeError, check_resume


def _cfg(model: dict | None = None, optim: dict | None = None, **trainer) -> TrainConfig:
    defaults = dict(max_steps=20, log_every=5, eval_every=10, checkpoint_every=10, progress=False)
    return TrainConfig(
        model=ModelConfig(**({"channels": [8, 16]} | (model or {}))),
        data=DataConfig(batch_size=32),
        optim=OptimConfig(**(optim or {})),
        trainer=TrainerConfig(**(defaults | trainer)),
    )


def _tree(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def _rows(run_dir) -> list[tuple[str, int]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["kind"], r["step"]) for r in map(json.loads, lines)]


# ------------------------------------------------------------------------------------------------- rules


def test_changes_of_what_is_trained_are_refused_naming_each_key():
    saved = _tree(_cfg())
    current = _tree(_cfg(model={"channels": [8, 32]}, optim={"lr": 0.05}))
    with pytest.raises(ResumeError) as error:
        check_resume(saved, current, step=10, where="ckpt")
    message = str(error.value)
    assert "\n" not in message
    assert "model.channels: [8, 16] -> [8, 32]" in message and "optim.lr: 0.1 -> 0.05" in message
    assert message.startswith("model.channels") and "hydra.run.dir" in message


def test_bookkeeping_changes_are_allowed_and_reported():
    saved = _tree(_cfg())
    current = _tree(_cfg(log_every=2, checkpoint_every=5, max_restarts=0, nproc_per_node=4))
    allowed = check_resume(saved, current, step=10)
    assert "trainer.log_every: 5 -> 2" in allowed and "trainer.nproc_per_node: 2 -> 4" in allowed


@pytest.mark.parametrize(
    "schedule, step, new_max, refused",
    [
        ("cosine", 10, 40, True),  # the cosine decay already followed would bend
        ("cosine", 10, 15, True),
        ("constant", 10, 40, False),  # the LR of every step does not depend on max_steps
        ("constant", 10, 15, False),
        ("constant", 30, 25, True),  # the checkpoint is already past the new end
    ],
)
def test_max_steps(schedule, step, new_max, refused):
    saved = _tree(_cfg(optim={"schedule": schedule}, max_steps=30))
    current = _tree(_cfg(optim={"schedule": schedule}, max_steps=new_max))
    if refused:
        with pytest.raises(ResumeError, match=f"trainer.max_steps: 30 -> {new_max}"):
            check_resume(saved, current, step=step)
    else:
        assert check_resume(saved, current, step=step) == [f"trainer.max_steps: 30 -> {new_max}"]


def test_a_key_unknown_to_the_rules_is_refused():
    saved = _tree(_cfg())
    current = _tree(_cfg()) | {"extra": {"knob": 1}}
    with pytest.raises(ResumeError, match="extra.knob: '<unset>' -> 1"):
        check_resume(saved, current, step=10)


# --------------------------------------------------------------------------- single-process runs of run()


def test_rerun_with_another_model_is_refused_before_loading(tmp_path):
    run(_cfg(), str(tmp_path))
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ResumeError) as error:
        run(_cfg(model={"channels": [8, 32]}), str(tmp_path))
    assert "model.channels: [8, 16] -> [8, 32]" in str(error.value)
    assert "size mismatch" not in str(error.value)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing touched


def test_rerun_of_a_finished_run_is_a_no_op(tmp_path):
    first = run(_cfg(), str(tmp_path))
    rows, written = _rows(tmp_path), (tmp_path / "summary.json").read_text()
    again = run(_cfg(), str(tmp_path))
    assert _rows(tmp_path) == rows
    assert rows == [("train", 5), ("train", 10), ("eval", 10), ("train", 15), ("train", 20), ("eval", 20)]
    assert again == first and (tmp_path / "summary.json").read_text() == written  # no time added, no resume
    assert "finished at step 20 already: nothing to do" in (tmp_path / "logs" / "rank0.log").read_text()


def test_wall_seconds_after_a_resume_leave_out_the_time_the_run_was_down(tmp_path):
    constant = {"schedule": "constant"}
    first = run(_cfg(optim=constant, max_steps=10), str(tmp_path))
    trained = torch.load(checkpoint_dir(tmp_path) / "step_00000010.pt", weights_only=False)["trained_seconds"]
    time.sleep(3.0)  # the run is down
    again = run(_cfg(optim=constant, max_steps=20), str(tmp_path))
    assert trained <= first["wall_seconds"] < first["attempt_wall_seconds"]  # without the start-up
    # what the first attempt spent training up to its checkpoint, and the second attempt's training: not
    # the 3 s between them, nor the second attempt's start-up
    assert trained < again["wall_seconds"] < trained + again["attempt_wall_seconds"]
    assert again["wall_seconds"] < first["wall_seconds"] + again["attempt_wall_seconds"] + 1.0


def test_final_loss_does_not_depend_on_the_logging_interval(tmp_path):
    every_5 = run(_cfg(log_every=5), str(tmp_path / "a"))
    every_3 = run(_cfg(log_every=3), str(tmp_path / "b"))
    assert every_5["final_loss"] == every_3["final_loss"]


def test_longer_constant_schedule_run_continues_exactly(tmp_path):
    straight = run(_cfg(optim={"schedule": "constant"}, max_steps=30), str(tmp_path / "a"))
    run(_cfg(optim={"schedule": "constant"}, max_steps=20), str(tmp_path / "b"))
    extended = run(_cfg(optim={"schedule": "constant"}, max_steps=30), str(tmp_path / "b"))
    assert extended["resumed_from_step"] == 20 and extended["steps"] == 30
    assert extended["final_loss"] == straight["final_loss"]
    train = [r for r in _rows(tmp_path / "b") if r[0] == "train"]
    assert train == [("train", s) for s in (5, 10, 15, 20, 25, 30)]


def test_rows_of_an_attempt_that_never_checkpointed_are_dropped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 5, "loss": 9.0}\n')
    run(_cfg(max_steps=10), str(tmp_path))
    assert _rows(tmp_path) == [("train", 5), ("train", 10), ("eval", 10)]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"] != 9.0


def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path):
    run(_cfg(keep_checkpoints=3), str(tmp_path))
    (checkpoint_dir(tmp_path) / "step_00000020.pt").write_bytes(b"")
    summary = run(_cfg(keep_checkpoints=3), str(tmp_path))
    assert summary["resumed_from_step"] == 10 and summary["steps"] == 20
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "skipped checkpoint step_00000020.pt" in log
    assert _rows(tmp_path).count(("eval", 20)) == 1
