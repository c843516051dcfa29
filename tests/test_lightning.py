"""Real Lightning DDP fits on CPU sync BN through distsync's plugin, with either Lightning package."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import _vision
import pytest
import torch

from distsync.testing import run_world

# Lightning imports torchmetrics, which imports torchvision if installed: here and in run_world's workers
_vision.ensure_importable()

PACKAGES = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(not importlib.util.find_spec(name.split(".")[0]), reason=name),
    )
    for name in ("lightning.pytorch", "pytorch_lightning")
]


def fit(tmp_path: Path, package: str, devices: int, group_size: int) -> list[dict]:
    """Run tests/lightning_app.py; every rank's report."""
    app = Path(__file__).with_name("lightning_app.py")
    env = {**os.environ, "PYTHONPATH": _vision.python_path(str(Path(__file__).parents[1]))}
    args = [sys.executable, str(app), str(tmp_path), package, str(devices), str(group_size)]
    run = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(devices)]


def expected_statistics(reports: list[dict], members: range) -> tuple[torch.Tensor, torch.Tensor]:
    """``momentum=None`` running statistics of the group ``members``: the average of each step's."""
    steps = zip(*(reports[rank]["batches"] for rank in members), strict=True)
    batches = [torch.tensor([row for batch in step for row in batch], dtype=torch.float64) for step in steps]
    return torch.stack([b.mean(0) for b in batches]).mean(0), torch.stack([b.var(0) for b in batches]).mean(0)


def assert_group_statistics(reports: list[dict], group_size: int) -> None:
    for rank, report in enumerate(reports):
        assert report["layer_during_fit"] == "DistSyncBatchNorm1d"
        assert report["layer_after_fit"] == "BatchNorm1d"  # Lightning reverts after fit
        first = rank - rank % group_size
        mean, var = expected_statistics(reports, range(first, first + group_size))
        assert report["running_mean"] == pytest.approx(mean.tolist(), rel=1e-5), rank
        assert report["running_var"] == pytest.approx(var.tolist(), rel=1e-5), rank


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_fit_syncs_batch_norm_over_the_world(tmp_path, package):
    assert_group_statistics(fit(tmp_path, package, devices=2, group_size=0), group_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES[:1])
def test_each_group_keeps_its_own_running_statistics(tmp_path, package):
    """DDP's broadcast of rank 0's buffers before every forward must not overwrite the other groups'."""
    reports = fit(tmp_path, package, devices=4, group_size=2)
    assert_group_statistics(reports, group_size=2)
    assert reports[0]["running_mean"] != reports[2]["running_mean"]


def _apply_with(rank, world_size, sizes):
    from distsync.lightning import DistSyncBatchNormPlugin

    plugin = DistSyncBatchNormPlugin(group_size=sizes[rank])
    model = plugin.apply(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
    layer = model[0]
    layer(torch.randn(2, 3))  # a synced call over the group the plugin chose
    return type(layer).__name__, layer.process_group, getattr(model, "_ddp_params_and_buffers_to_ignore", [])


def test_group_size_zero_and_the_world_size_mean_the_same():
    pytest.importorskip("distsync.lightning")
    for name, group, ignored in run_world(_apply_with, 2, [0, 2]):
        assert (name, group, ignored) == ("DistSyncBatchNorm1d", None, [])
