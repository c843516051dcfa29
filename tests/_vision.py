"""Make torchvision importable beside a torch its compiled ops were not built for; tests only.

The torchvision wheel from the package registry is built against the CUDA torch. Beside the CPU build of the
same torch release its ``_C`` extension does not load (it links ``libtorch_cuda``), and ``import torchvision``
then fails with ``operator torchvision::nms does not exist``: ``torchvision/_meta_registrations.py`` registers
fake kernels for ``nms`` and ``qnms``, ops whose schemas only the extension defines. Its models, datasets and
transforms are pure Python and need none of its ops, so defining those two schemas (without kernels) before
torchvision's first import is enough to use them; calling ``torchvision.ops.nms`` still raises. Where the
extension loads, nothing is changed.

Once torchvision is installed, whatever imports it must be able to: Lightning does (through torchmetrics).
:func:`ensure_importable` makes it importable in this process. ``conftest.py`` calls it for the pytest
process; test modules whose code imports torchvision call it at import too, for the workers of
``distsync.testing.run_world`` (which import the test module to find their function, not ``conftest.py``).
A launched command gets ``PYTHONPATH=python_path()``, whose ``sitecustomize.py`` runs it at the start of each
of its processes. The distsync package never imports this module.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import torch

__all__ = ["ensure_importable", "python_path"]

_SITE_DIR = Path(__file__).resolve().parent / "_site"

# The ops torchvision 0.28 registers fakes for at import, with the schemas its extension would define.
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None  # kept alive: a collected Library removes its definitions


def _extension_loads(package_dir: Path) -> bool:
    """Whether torchvision's compiled extension loads here (what ``torchvision.extension`` will try first):
    ``_C`` up to torchvision 0.28, ``_C_stable`` from 0.29."""
    finder = importlib.machinery.FileFinder(
        str(package_dir), (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    )
    for name in ("_C_stable", "_C"):
        spec = finder.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        try:
            torch.ops.load_library(spec.origin)
        except OSError:
            return False
        return True
    return False


def ensure_importable() -> bool:
    """Make ``import torchvision`` work in this process; return whether torchvision is installed.

    Idempotent. Does nothing when torchvision is already imported, its ops are defined (by an earlier call,
    through another copy of this module too) or its compiled ops load.
    """
    global _library
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    if "torchvision" in sys.modules or hasattr(torch.ops.torchvision, "nms"):
        return True
    if not _extension_loads(Path(next(iter(spec.submodule_search_locations)))):
        _library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            _library.define(schema)
    return True


def python_path(*paths: str) -> str:
    """A ``PYTHONPATH`` (``paths``, then this environment's) for a command whose processes import torchvision.

    Give it to every subprocess that may import torchvision, directly or not: Lightning imports torchmetrics,
    which imports torchvision when it is installed.
    """
    return os.pathsep.join(filter(None, [str(_SITE_DIR), *paths, os.environ.get("PYTHONPATH")]))
