"""The Ray Train recipe of docs/your_app.md (examples/recipes/ray_train.py), run as a user runs it: two CPU
workers of a local Ray cluster; skipped where ray[train] is not installed."""

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
