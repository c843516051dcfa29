"""The package's import graph, read from the source (an AST walk, nothing imported): no module of
``distsync/`` or ``hydra_plugins/`` imports itself back through others, and none imports another module's
underscore names. Imports under ``if TYPE_CHECKING:`` are annotations only and do not count."""

from __future__ import annotations

import ast
import collections
import json
import sys
from pathlib import Path

import pytest
from launching import run_job

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("distsync", "hydra_plugins")


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module under ``packages`` by dotted name (a package by its own name)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """The tree's nodes, leaving out the bodies of ``if TYPE_CHECKING:``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))


def _target(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_graph(found: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """Which of ``found`` each module imports, and the imports of another module's underscore names."""
    edges: dict[str, set[str]] = {name: set() for name in found}
    private: list[str] = []
    for name, path in found.items():
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in found:
                        target = target.rpartition(".")[0]
                    if target:
                        edges[name].add(target)
            elif isinstance(node, ast.ImportFrom):
                target = _target(name, node, path.name == "__init__.py")
                for alias in node.names:
                    if f"{target}.{alias.name}" in found:  # a submodule
                        edges[name].add(f"{target}.{alias.name}")
                    elif target in found:
                        edges[name].add(target)
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            private.append(f"{name} imports {target}.{alias.name}")
        edges[name].discard(name)
    return edges, private


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_and_no_private_names_across_modules():
    edges, private = import_graph(modules(ROOT, PACKAGES))
    assert len(edges) > 50  # the walk found the package
    assert circles(edges) == []
    assert private == []


@pytest.mark.parametrize("under_type_checking", [False, True])
def test_a_planted_circle_is_found(tmp_path, under_type_checking):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import helper\n")
    (package / "a.py").write_text("from pkg.sub import helper\nfrom .c import _hidden\n")
    back = "from ..a import thing\n"
    if under_type_checking:
        back = f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {back}"
    (package / "sub" / "b.py").write_text(f"def helper(): ...\n{back}")
    (package / "c.py").write_text("def _hidden(): ...\n")
    edges, private = import_graph(modules(tmp_path, ("pkg",)))
    assert private == ["pkg.a imports pkg.c._hidden"]
    expected = [] if under_type_checking else [["pkg.a", "pkg.sub", "pkg.sub.b"]]
    assert circles(edges) == expected


LAZY_PACKAGES = ("hydra", "omegaconf", "distsync.launching", "distsync.parallel", "distsync.tuning")


def test_import_distsync_loads_the_layer_only_and_every_top_level_name_on_use(tmp_path):
    """``import distsync`` in a fresh interpreter loads neither Hydra, OmegaConf, the launcher, the
    DataParallel shim nor the Optuna helpers; each top-level name of theirs then still resolves, to the object
    its own module defines, and the shim's names at the top level are exactly the shim's ``__all__``."""
    script = f"""
import json, sys
import distsync
loaded = sorted(m for m in sys.modules if m.startswith({LAZY_PACKAGES!r}))
reached = distsync.tuning.report_result.__module__  # a subpackage reached without an import, as before
import distsync.parallel
names = {{name: getattr(distsync, name).__module__ for name in distsync.__all__}}
print(json.dumps({{"loaded": loaded, "names": names, "shim": distsync.parallel.__all__, "reached": reached,
                  "dir": sorted(set(distsync.__all__) - set(dir(distsync)))}}))
"""
    proc = run_job([sys.executable, "-c", script], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["loaded"] == [] and result["reached"] == "distsync.tuning"
    assert set(result["shim"]) <= set(result["names"])
    assert result["names"]["launch"] == "distsync.launching.elastic"
    assert result["names"]["ReplicationCallbackDataParallel"].startswith("distsync.parallel")
    assert result["names"]["should_prune"] == "distsync.tuning"
    assert result["dir"] == []


def test_an_unknown_top_level_name_is_an_attribute_error():
    import distsync

    with pytest.raises(AttributeError, match="no attribute 'SyncBatchNorm2d'"):
        distsync.SyncBatchNorm2d  # noqa: B018


def test_no_two_modules_share_a_file_name():
    """A file name says what a module is wherever it is met (a traceback, an import line)."""
    files = [path.name for path in (ROOT / "distsync").rglob("*.py")]
    names = collections.Counter(name for name in files if name not in ("__init__.py", "__main__.py"))
    assert [name for name, count in names.items() if count > 1] == []
