"""Run by Python at startup with this folder on ``PYTHONPATH``: torchvision importable in launched jobs.

The end-to-end tests put it there (see ``tests/_vision.py``) so that every process of a launched command,
torchrun's workers included, can import torchvision's models. Only the tests do; the package never does.
"""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_vision", Path(__file__).resolve().parents[1] / "_vision.py")
_vision = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vision)
_vision.ensure_importable()
