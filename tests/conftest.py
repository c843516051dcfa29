import _vision
import pytest
import torch

_vision.ensure_importable()  # torchvision's models importable beside the CPU torch (see _vision.py)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
