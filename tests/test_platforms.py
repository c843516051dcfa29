"""The Pythons and torch releases the project claims (pyproject.toml) are those CI runs (.ci/run): the oldest
claimed of each, and the newest Python claimed."""

from __future__ import annotations

import re

import pytest
from launching import ROOT
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")


def _ci_runs() -> list[tuple[str, str]]:
    """(torch release, Python) of every line of ``.ci/run``'s ``releases`` function."""
    (body,) = re.findall(r"^releases\(\) \{\n(.*?)^\}", (ROOT / ".ci" / "run").read_text(), re.M | re.S)
    return re.findall(r'^\s+"\$@" (\S+) (\S+)$', body, re.M)


def test_ci_runs_the_oldest_and_newest_python_and_the_oldest_torch_claimed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    prefix = "Programming Language :: Python :: 3."
    claimed = sorted(Version(c.rpartition(" :: ")[2]) for c in project["classifiers"] if c.startswith(prefix))
    assert claimed and project["requires-python"] == f">={claimed[0]}"
    runs = _ci_runs()
    assert {str(claimed[0]), str(claimed[-1])} <= {python for _, python in runs}, runs
    (torch,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "torch"]
    floor = next(Version(spec.version) for spec in torch.specifier if spec.operator == ">=")
    assert min(Version(release) for release, _ in runs).release[:2] == floor.release[:2]  # 2.4.1 for >=2.4
