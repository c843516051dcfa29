"""A real 2-process PyTorch Lightning DDP run on CPU syncs BN through distsync's plugin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")


@pytest.mark.parametrize("group_size", [0, 1])
def test_lightning_ddp_on_cpu_syncs_batch_norm(tmp_path, group_size):
    out = tmp_path / "result.json"
    app = Path(__file__).with_name("lightning_app.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run(
        [sys.executable, str(app), str(out), str(group_size)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layer_during_fit"] == "DistSyncBatchNorm1d"
    assert result["layer_after_fit"] == "BatchNorm1d"  # Lightning reverts after fit
    # group size 0: the statistics of all 8 samples; group size 1: of rank 0's own 4 (its group alone)
    for key in ("mean", "var"):
        assert result[f"running_{key}"] == pytest.approx(result[f"expected_{key}"], rel=1e-5), key
