"""A world whose size its function asks for: ``distsync.launch(nproc_per_node=None)``, and
``hydra/launcher=torchrun`` without ``hydra.launcher.nproc_per_node`` on an app that calls
``distsync.launch(train, cfg, nproc_per_node=...)`` itself."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from elastic_fns import launches_its_own, rank_and_config
from launching import ROOT, run_job

import distsync


def test_a_world_sized_by_its_function_has_the_size_the_functions_own_launch_asks_for(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert distsync.launch(launches_its_own, 2, nproc_per_node=None) == (0, 2, "inner")
    assert distsync.launch(launches_its_own, 1, nproc_per_node=None) == (0, 1, "inner")
    assert distsync.launch(rank_and_config, "plain", nproc_per_node=None) == (0, 1, "plain")  # never asks
    assert distsync.launch(launches_its_own, 3, nproc_per_node=2) == (0, 2, "inner")  # given: it stands


@pytest.mark.slow
def test_the_apps_own_nproc_per_node_stands_under_the_plugin_unless_the_launcher_gives_one(tmp_path):
    """examples/hydra_app asks distsync.launch for its config's nproc_per_node (2): under
    hydra/launcher=torchrun its jobs are 2-rank worlds, unless hydra.launcher.nproc_per_node says other."""
    app = tmp_path / "my_app"
    ignore = shutil.ignore_patterns("outputs", "multirun")
    shutil.copytree(ROOT / "examples" / "hydra_app", app, ignore=ignore)
    for given, sizes in (([], [2, 2]), (["hydra.launcher.nproc_per_node=1"], [1, 1])):
        sweep = tmp_path / f"sweep{len(given)}"
        args = ["-m", "hydra/launcher=torchrun", *given, "lr=0.05,0.2", "steps=3", f"hydra.sweep.dir={sweep}"]
        proc = run_job([sys.executable, "app.py", *args], cwd=app, timeout=240)
        assert proc.returncode == 0
        records = [json.loads((sweep / str(job) / "rank0.json").read_text()) for job in (0, 1)]
        assert [r["world_size"] for r in records] == sizes
        assert [r["config"]["lr"] for r in records] == [0.05, 0.2]
