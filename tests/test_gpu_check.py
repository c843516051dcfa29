"""The GPU check (tests/gpu/) is ready to run when a GPU is at hand: it parses, plans, and dry-runs here."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys

import pytest
from launching import ROOT
from packaging.requirements import Requirement

from distsync.testing import timeout_scale

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

GPU = ROOT / "tests" / "gpu"
sys.path.insert(0, str(GPU))
check = importlib.import_module("check")


def test_the_plan_names_every_part_and_fits_the_time_limit():
    proc = subprocess.run(
        [sys.executable, str(GPU / "check.py"), "--plan"], capture_output=True, text=True, check=True
    )
    names = [line.split()[0] for line in proc.stdout.splitlines()[:-1]]
    assert names == [part.name for part in check.PARTS] and len(names) == 8
    default = [part for part in check.PARTS if part.default]
    assert sum(part.limit_s for part in default) <= check.TOTAL_LIMIT_S <= 8 * 60 - 30  # install, report
    assert all(part.limit_s <= check.TOTAL_LIMIT_S for part in check.PARTS)  # --only step fits too
    assert re.search(r"^step .*--only step: on the CPU", proc.stdout, re.M), proc.stdout
    for part in check.PARTS:  # without CUDA here: the GPU-only parts say they are skipped
        expected = "skipped: needs CUDA" if part.needs_cuda else "on the CPU"
        assert re.search(rf"^{part.name} .*{expected}", proc.stdout, re.M), proc.stdout


def test_in_the_dry_run_the_time_limits_grow_as_the_tests_do():
    """On the CPU every limit is the tests' factor for a busy machine times the GPU run's own."""
    env = dict(os.environ, DISTSYNC_TEST_TIMEOUT_SCALE="3")
    proc = subprocess.run(
        [sys.executable, str(GPU / "check.py"), "--plan"], capture_output=True, text=True, check=True, env=env
    )
    limits = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines()[:-1]}
    assert limits == {part.name: 3 * part.limit_s for part in check.PARTS}
    assert proc.stdout.splitlines()[-1].startswith(f"total limit {3 * check.TOTAL_LIMIT_S} s")


def test_every_part_resolves_to_a_function():
    for part in check.PARTS:
        module, function = part.target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), part


def test_the_carried_wheels_satisfy_the_project_and_the_script_parses():
    subprocess.run(["bash", "-n", str(GPU / "run.sh")], check=True)
    pinned = {}
    for line in (GPU / "wheels.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name] = version
    assert set(pinned) == {"hydra-core", "omegaconf", "antlr4-python3-runtime"}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in map(Requirement, project):
        if requirement.name in pinned:
            assert requirement.specifier.contains(pinned[requirement.name]), requirement


@pytest.mark.slow
def test_the_dry_run_on_the_cpu_passes_what_it_runs_and_skips_the_rest(tmp_path):
    """About a minute: the parts that can run on the CPU run smaller there, so their code is exercised.
    The check's limits and this test's wait grow by the same factor for a busy machine."""
    scale = timeout_scale()
    proc = subprocess.run(
        [sys.executable, str(GPU / "check.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=(check.TOTAL_LIMIT_S + 60) * scale,
        check=False,
        env=dict(os.environ, DISTSYNC_TEST_TIMEOUT_SCALE=str(scale)),
    )
    report = json.loads((tmp_path / "report.json").read_text())
    statuses = {name: part["status"] for name, part in report["parts"].items()}
    expected = {part.name: "SKIP" if part.needs_cuda else "PASS" for part in check.PARTS if part.default}
    assert statuses == expected, proc.stdout + proc.stderr
    assert proc.returncode == 0
    markdown = (tmp_path / "report.md").read_text()
    assert "| 6. Speed, side by side | PASS |" in markdown and "Skipped: needs CUDA" in markdown
    assert not (tmp_path / ".parts").exists()


@pytest.mark.slow
def test_the_step_part_runs_alone_and_compares_every_variant_eager_and_compiled(tmp_path):
    """``--only step`` in the dry run: a small conv net's training step, native BN, distsync and
    nn.SyncBatchNorm's synchronized path, eager and under torch.compile, in one table per mode."""
    scale = timeout_scale()
    proc = subprocess.run(
        [sys.executable, str(GPU / "check.py"), "--only", "step", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600 * scale, check=False,
        env=dict(os.environ, DISTSYNC_TEST_TIMEOUT_SCALE=str(scale)),
    )  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["parts"]) == ["step"] and proc.returncode == 0, proc.stdout + proc.stderr
    part = report["parts"]["step"]
    assert [table["title"].rsplit(", ", 1)[-1] for table in part["tables"]] == ["eager", "default"]
    for table in part["tables"]:
        assert [row[1] for row in table["rows"]] == ["native", "distsync", "nn.SyncBatchNorm"]
        assert all(row[2] != "n/a" for row in table["rows"][:2]), table  # native and distsync measured
    assert part["figures"]["step default, batch 4, distsync / native"] > 0
