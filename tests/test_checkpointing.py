"""Activation checkpointing: a recomputed synced layer reuses its call's statistics, bit for bit."""

import functools

import pytest
import torch
from bn_subclasses import ActNorm2d
from cuda_emulation import cuda_path_on_cpu
from torch import nn
from torch.utils.checkpoint import checkpoint

import distsync
from distsync import _transport
from distsync.testing import run_world


class _Net(nn.Module):
    """conv, [BN, ReLU, conv, a BN called twice, a converted subclass] checkpointed, conv: the middle is
    recomputed."""

    def __init__(self, use_checkpoint):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 4, 3)
        self.bn = distsync.DistSyncBatchNorm2d(4, momentum=None)
        self.conv = nn.Conv2d(4, 4, 1)
        self.shared = distsync.DistSyncBatchNorm2d(4)
        self.act = distsync.convert_sync_batchnorm(ActNorm2d(4, momentum=None))  # a converted subclass
        self.head = nn.Conv2d(4, 2, 1)
        self.use_checkpoint = use_checkpoint

    def middle(self, x):
        x = self.shared(self.conv(torch.relu(self.bn(x))))
        return self.act(self.shared(x * 2 + 1))  # the same layer again, on other values

    def forward(self, x):
        x = self.stem(x)
        if self.use_checkpoint:
            x = checkpoint(self.middle, x, use_reentrant=self.use_checkpoint == "reentrant")
        else:
            x = self.middle(x)
        return self.head(x)


def _steps(rank, world_size, use_checkpoint, cuda_path=False, steps=3):
    if cuda_path:  # the CUDA path's code on CPU tensors: the recomputed call found on the "device"
        with cuda_path_on_cpu():
            return _steps(rank, world_size, use_checkpoint, False, steps)
    calls = []
    original = _transport.ProcessGroupReducer.all_reduce

    @functools.wraps(original)
    def counted(self, payload):
        calls.append(payload.numel())
        return original(self, payload)

    _transport.ProcessGroupReducer.all_reduce = counted
    try:
        model = _Net(use_checkpoint)
        results = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(10 * step + rank)
            x = (torch.randn(2 + rank, 3, 6, 6, generator=gen) * 3 + 1).requires_grad_()
            out = model(x)
            out.square().sum().backward()
            results.append([out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())])
            model.zero_grad()
        # ActNorm2d's own call counter counts the recomputation too, as its forward says: left out
        buffers = [b.clone() for name, b in model.named_buffers() if name != "act.calls"]
        return results, buffers, len(calls)
    finally:
        _transport.ProcessGroupReducer.all_reduce = original


def _all_modes(rank, world_size, cuda_path):
    """Plain, reentrant and non-reentrant runs of the same steps, in one world."""
    return {mode: _steps(rank, world_size, mode, cuda_path) for mode in (False, "reentrant", "non-reentrant")}


@pytest.mark.parametrize("cuda_path", [False, True], ids=["cpu-path", "cuda-path"])
def test_checkpointed_steps_equal_plain_steps_with_no_extra_all_reduce(cuda_path):
    for runs in run_world(_all_modes, 2, cuda_path):
        want_results, want_buffers, want_calls = runs[False]
        for mode in ("reentrant", "non-reentrant"):
            results, buffers, calls = runs[mode]
            for got, want in zip(results, want_results, strict=True):
                for a, b in zip(got, want, strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=mode)
            for a, b in zip(buffers, want_buffers, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=mode)  # num_batches_tracked 3, not 6
            # 4 synced calls per step (bn, shared twice, act), one all-reduce forward and one backward each;
            # the CPU may merge a call far from its shift again (a second forward all-reduce), alike in all
            assert calls == want_calls and calls >= 4 * 2 * 3, mode
