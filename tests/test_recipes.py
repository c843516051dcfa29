"""The recipes of docs/recipes.md, run as users run them: torchrun, 2 CPU ranks, real accelerate and mmengine.

Each recipe trains a few steps and writes what every rank ended with: the synchronized layer's weight
(equal on every rank only if the library averaged the gradients) and running mean (equal only if the
statistics were synchronized), and must not warn that no data-parallel wrapper drives the model.
"""

import json
import sys

import _vision
import pytest
from launching import ROOT, run_job

RECIPES = ROOT / "examples" / "recipes"


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, library", [("accelerate_train.py", "accelerate"), ("mmengine_train.py", "mmengine")]
)
def test_recipe_trains_data_parallel_with_synchronized_statistics(recipe, library, tmp_path):
    pytest.importorskip(library)
    report = tmp_path / "report"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(RECIPES / recipe)]
    proc = run_job(
        command, tmp_path, timeout=240, RECIPE_REPORT=str(report), RECIPE_WORK_DIR=str(tmp_path / "work"),
        PYTHONPATH=_vision.python_path(),
    )  # fmt: skip
    assert proc.returncode == 0
    assert "data-parallel wrapper" not in proc.stderr + proc.stdout
    ranks = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    assert ranks[0]["weight"] == ranks[1]["weight"]  # gradients averaged
    assert ranks[0]["running_mean"] == ranks[1]["running_mean"]  # statistics synchronized
    assert any(abs(w - 1.0) > 1e-4 for w in ranks[0]["weight"])  # and it trained
