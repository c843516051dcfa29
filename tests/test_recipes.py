"""The recipes of docs/recipes.md, run as users run them: torchrun, 2 CPU ranks, real accelerate and mmengine.

Each recipe trains a few steps and writes what every rank ended with: the synchronized layer's weight
(equal on every rank only if the library averaged the gradients) and running mean (equal only if the
statistics were synchronized), and must not warn that no data-parallel wrapper drives the model.
Code that docs/migration.md gives is run from the page itself.
"""

import copy
import json
import re
import sys
import textwrap

import _vision
import pytest
import torch
import torch.nn.functional as F
from launching import ROOT, run_job
from torch import nn

import distsync
from distsync.testing import run_world

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


def _python_block_defining(page: str, name: str) -> str:
    """The Python code block of ``docs/<page>`` that defines ``name``, as a user would copy it."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)
    found = [textwrap.dedent(block) for block in blocks if f"def {name}(" in block]
    assert len(found) == 1, f"docs/{page} has {len(found)} blocks defining {name}"
    return found[0]


def _loss_world(rank, world_size, snippet):
    """DDP with the migration guide's loss, against DataParallel's loss on the gathered batch: an ignored
    label on most pixels of rank 0's samples and few of rank 1's."""
    namespace = {}
    exec(snippet, namespace)  # the documented code, as written
    global_mean_loss = namespace["global_mean_loss"]
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 5, 1)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=gen)
    target = torch.randint(0, 5, (4, 6, 6), generator=gen)
    ignored = torch.rand(4, 6, 6, generator=gen) < torch.tensor([0.9, 0.9, 0.1, 0.1]).view(4, 1, 1)
    target[ignored] = 255
    rows = slice(2 * rank, 2 * rank + 2)
    grads = {}
    for loss_fn in ("documented", "per-rank mean"):
        model = nn.parallel.DistributedDataParallel(distsync.convert_sync_batchnorm(copy.deepcopy(plain)))
        out = model(x[rows])
        if loss_fn == "documented":
            loss = global_mean_loss(out, target[rows])
        else:
            loss = F.cross_entropy(out, target[rows], ignore_index=255)
        loss.backward()
        grads[loss_fn] = [p.grad for p in model.parameters()]
    F.cross_entropy(plain(x), target, ignore_index=255).backward()  # DataParallel: one loss, whole batch
    return {
        loss_fn: max((g - p.grad).abs().max().item() for g, p in zip(found, plain.parameters(), strict=True))
        for loss_fn, found in grads.items()
    }


def test_the_migration_guides_loss_keeps_data_parallels_mean_over_valid_targets():
    snippet = _python_block_defining("migration.md", "global_mean_loss")
    for errors in run_world(_loss_world, 2, snippet):
        assert errors["documented"] < 1e-12
        assert errors["per-rank mean"] > 1e-3  # what the guide warns about
