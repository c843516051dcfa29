"""``benchmarks/_sketch.py`` times the bare steps of a synchronized call as the floor of distsync's design in
Python (``host_cost.py``, ``host_floor_sketch.py``); that floor only means something if the sketch does all
the work a synchronized call must do. Here it does: on one process it equals torch's training-mode batch
norm (outputs, input and parameter gradients, running statistics, the batch count) for 3D and 4D inputs, and
it all-reduces a payload in each direction."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from distsync._syncbn.payload import TAIL

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_sketch.py"


def _sketch_module():
    spec = importlib.util.spec_from_file_location("benchmark_sketch", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", [(2, 8, 2, 2), (8, 64, 8, 8), (4, 3, 5)])
def test_the_sketch_computes_what_batch_norm_computes(shape):
    sketch = _sketch_module().Sketch
    torch.manual_seed(0)
    x, grad = torch.randn(shape) * 3 + 2, torch.randn(shape)
    reference, measured = nn.BatchNorm1d(shape[1]), nn.BatchNorm1d(shape[1])
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-1, 1)
    measured.load_state_dict(reference.state_dict())
    reduced = []

    def all_reduce(payload: torch.Tensor) -> None:  # one rank: the sum is the payload itself
        reduced.append(payload.clone())

    x_ref, x_sketch = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = nn.functional.batch_norm(
        x_ref, reference.running_mean, reference.running_var, reference.weight, reference.bias, True, 0.1
    )
    expected.backward(grad)
    reference.num_batches_tracked.add_(1)
    buffers = (measured.running_mean, measured.running_var, measured.num_batches_tracked)
    out = sketch.apply(x_sketch, measured.weight, measured.bias, buffers, all_reduce)
    out.backward(grad)

    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x_sketch.grad, x_ref.grad)
    torch.testing.assert_close(measured.weight.grad, reference.weight.grad)
    torch.testing.assert_close(measured.bias.grad, reference.bias.grad)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(measured.state_dict()[name], value, msg=name)
    count = x.numel() // shape[1]
    assert [payload[-TAIL].item() for payload in reduced] == [count, 0.0]  # forward counted, backward not
