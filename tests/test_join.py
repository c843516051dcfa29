"""Uneven numbers of batches per rank under DDP's Join: synced layers shadowed by the ranks that joined."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import distsync
from distsync.testing import run_world


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 2, 1)
        self.bn2 = nn.BatchNorm2d(2, momentum=None)
        self.extra = nn.BatchNorm2d(2, affine=False)  # no parameters: DDP needs no find_unused_parameters
        self.use_extra = False

    def forward(self, x):
        x = self.bn2(self.head(torch.relu(self.bn(self.conv(x)))))
        return self.extra(x) if self.use_extra else x


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(2 + rank, 3, 5, 5, generator=gen, dtype=torch.float64) * 2 + 1


def _train(rank, world_size, counts, extra_at=None):
    model = distsync.convert_sync_batchnorm(_Net())
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    layers = distsync.joinable(ddp)
    results = []
    try:
        with Join([layers, ddp]):
            for step in range(counts[rank]):
                model.use_extra = step == extra_at
                x = _batch(rank, step).float().requires_grad_()
                out = ddp(x)
                (out * out.detach().sign()).sum().backward()
                results.append((out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
                model.zero_grad()
    except (distsync.SyncMismatchError, distsync.SyncError, RuntimeError) as error:
        return type(error).__name__
    buffers = {k: v for k, v in model.state_dict().items() if "running" in k or "tracked" in k}
    return results, buffers


def _reference(counts):
    model = _Net().double()
    results, world_size = [], len(counts)
    for step in range(max(counts)):
        ranks = [r for r in range(world_size) if step < counts[r]]
        x = torch.cat([_batch(r, step) for r in ranks]).requires_grad_()
        out = model(x)
        (out * out.detach().sign()).sum().backward()
        sizes = [2 + r for r in ranks]
        outs, grads = out.detach().split(sizes), x.grad.split(sizes)
        params = [p.grad.clone() / world_size for p in model.parameters()]  # DDP: averaged over the world
        results.append({r: (outs[i], grads[i], params) for i, r in enumerate(ranks)})
        model.zero_grad()
    buffers = {k: v for k, v in model.state_dict().items() if "running" in k or "tracked" in k}
    return results, buffers


@pytest.mark.parametrize("counts", [[3, 1], [3, 2, 1]], ids=["2-ranks", "3-ranks"])
def test_joined_ranks_shadow_the_synced_layers(counts):
    expected, expected_buffers = _reference(counts)
    for rank, (results, buffers) in enumerate(run_world(_train, len(counts), counts)):
        assert len(results) == counts[rank]
        for step, (out, x_grad, params) in enumerate(results):
            want_out, want_grad, want_params = expected[step][rank]
            torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(x_grad.double(), want_grad, rtol=1e-4, atol=1e-4)
            for got, want in zip(params, want_params, strict=True):
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        for key, want in expected_buffers.items():  # joined ranks followed every step
            torch.testing.assert_close(buffers[key].to(want.dtype), want, rtol=1e-5, atol=1e-5, msg=key)


def _mismatch(rank, world_size, counts, extra_at, sync_buffers):
    """What each rank raises, and the message, when rank 0's synced calls change after others joined."""
    model = distsync.convert_sync_batchnorm(_Net())
    ddp = DistributedDataParallel(model, forward_sync_buffers=sync_buffers)
    try:
        with Join([distsync.joinable(ddp), ddp]):
            for step in range(counts[rank]):
                model.use_extra = step == extra_at
                ddp(_batch(rank, step).float()).sum().backward()
    except Exception as error:  # the test compares what each rank raised
        return type(error).__name__, str(error)
    return None, ""


@pytest.mark.parametrize(
    "counts, sync_buffers", [([3, 1], False), ([3, 2, 1], True)], ids=["2-ranks", "3-ranks-buffers"]
)
def test_synced_calls_that_change_after_a_rank_joined_raise_on_every_rank(counts, sync_buffers):
    """Rank 0 calls an extra layer at its last step, after the others joined: the ranks replaying their last
    step find it from the reduced values as rank 0 does, and raise at once (not once rank 0 has left)."""
    outcomes = run_world(_mismatch, len(counts), counts, 2, sync_buffers, timeout=150)
    assert [name for name, _ in outcomes] == ["SyncMismatchError"] * len(counts), outcomes
    assert "'extra'" in outcomes[0][1]
    for _, message in outcomes[1:]:  # the joined ranks say what happened, and which call they replayed
        assert "joined" in message and "changed" in message and "out of step at 'bn2'" in message


def _wrong_order(rank, world_size):
    model = distsync.convert_sync_batchnorm(_Net())
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    try:
        with Join([ddp, distsync.joinable(ddp)]):
            ddp(_batch(rank, 0).float()).sum().backward()
    except ValueError as error:
        return str(error)
    return None


def test_the_joinable_must_come_first():
    for message in run_world(_wrong_order, 2):
        assert message is not None and "must come first" in message
