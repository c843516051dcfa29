"""Uneven numbers of batches per rank under DDP's Join: a joined rank shadows the synced collectives.

Every case trains a model under ``Join`` on ranks with different numbers of batches and compares each step
with float64 ``nn.BatchNorm`` on the concatenated batches of the ranks that have one that step: outputs,
input and parameter gradients (averaged by DDP over the world), and the running statistics every rank ends
with (the joined ones followed).
"""

import copy
import gc
import io
import weakref

import pytest
import torch
import torch.utils.checkpoint
from collective_count import counted_all_reduces
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import distsync
from distsync.testing import run_world


class _TwiceNorm(nn.BatchNorm2d):
    """A subclass calling the base forward twice."""

    def forward(self, x):
        return super().forward(super().forward(x) * 2 + 1)


class _TokenNorm(nn.BatchNorm1d):
    """Batch norm over tokens, (N, L, C): transpose, the base forward, transpose back."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class _Net(nn.Module):
    def __init__(self, variant="plain"):
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = _TwiceNorm(4) if variant == "subclass twice" else nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 2, 1)
        self.bn2 = nn.BatchNorm2d(2, momentum=None)
        self.tokens = _TokenNorm(2, affine=False)
        self.extra = nn.BatchNorm2d(2, affine=False)  # no parameters: DDP needs no find_unused_parameters
        self.use_extra = False

    def middle(self, x):
        return self.bn2(self.head(torch.relu(self.bn(x))))

    def forward(self, x):
        x = self.conv(x)
        if self.variant.startswith("checkpoint"):
            reentrant = self.variant.endswith("reentrant")
            x = torch.utils.checkpoint.checkpoint(self.middle, x, use_reentrant=reentrant)
        else:
            x = self.middle(x)
        if self.variant == "tokens":
            n, c, h, w = x.shape
            x = self.tokens(x.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(n, c, h, w)
        return self.extra(x) if self.use_extra else x


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(2 + rank, 3, 5, 5, generator=gen, dtype=torch.float64) * 2 + 1


def _loss(out):
    return (out * out.detach().sign()).sum()


def _train(rank, world_size, counts, variant="plain", extra_at=None, epochs=1):
    model = distsync.convert_sync_batchnorm(_Net(variant))
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    forward = torch.compile(ddp, backend="aot_eager") if variant == "compiled" else ddp
    seen_inputs = []
    model.bn.register_forward_hook(lambda module, args, out: seen_inputs.append(args[0].shape[0]))
    layers = distsync.joinable(ddp)
    results = []
    for epoch in range(epochs):
        if epoch:  # a new joinable for every Join, as the error messages' own recipe reads
            layers = distsync.joinable(ddp)
        with Join([layers, ddp]):
            for step in range(counts[rank]):
                model.use_extra = step == extra_at
                x = _batch(rank, step + 10 * epoch).float().requires_grad_()
                out = forward(x)
                _loss(out).backward()
                results.append((out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
                model.zero_grad()
    buffers = {k: v for k, v in model.state_dict().items() if "running" in k or "tracked" in k}
    return results, buffers, seen_inputs


def _reference(counts, variant="plain", extra_at=None, epochs=1):
    plain = variant == "compiled" or variant.startswith("checkpoint")
    model = _Net("plain" if plain else variant).double()
    results, world_size = [], len(counts)
    for epoch in range(epochs):
        for step in range(max(counts)):
            model.use_extra = step == extra_at
            ranks = [r for r in range(world_size) if step < counts[r]]
            x = torch.cat([_batch(r, step + 10 * epoch) for r in ranks]).requires_grad_()
            out = model(x)
            _loss(out).backward()
            sizes = [2 + r for r in ranks]
            outs, grads = out.detach().split(sizes), x.grad.split(sizes)
            params = [p.grad.clone() / world_size for p in model.parameters()]  # DDP: averaged over the world
            results.append({r: (outs[i], grads[i], params) for i, r in enumerate(ranks)})
            model.zero_grad()
    buffers = {k: v for k, v in model.state_dict().items() if "running" in k or "tracked" in k}
    return results, buffers


def _check_against_reference(counts, variant="plain", extra_at=None, epochs=1):
    expected, expected_buffers = _reference(counts, variant, extra_at, epochs)
    per_rank = run_world(_train, len(counts), counts, variant, extra_at, epochs, timeout=150)
    for rank, (results, buffers, seen_inputs) in enumerate(per_rank):
        assert len(results) == counts[rank] * epochs
        steps = [s + epoch * max(counts) for epoch in range(epochs) for s in range(counts[rank])]
        for step, (out, x_grad, params) in zip(steps, results, strict=True):
            want_out, want_grad, want_params = expected[step][rank]
            torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(x_grad.double(), want_grad, rtol=1e-4, atol=1e-4)
            for got, want in zip(params, want_params, strict=True):
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        for key, want in expected_buffers.items():  # joined ranks followed every step
            torch.testing.assert_close(buffers[key].to(want.dtype), want, rtol=1e-5, atol=1e-5, msg=key)
        assert 0 not in seen_inputs  # no module of a joined rank ran: its hooks never saw an empty batch


@pytest.mark.parametrize("counts", [[3, 1], [3, 2, 1]], ids=["2-ranks", "3-ranks"])
def test_joined_ranks_shadow_the_synced_layers(counts):
    _check_against_reference(counts)


@pytest.mark.parametrize(
    "variant", ["checkpoint-reentrant", "checkpoint", "subclass twice", "tokens", "compiled"]
)
def test_joined_ranks_shadow_whatever_the_step_calls(variant):
    """Activation checkpointing (both modes), a subclass calling the base forward twice, batch norm over
    tokens (transposed inputs), a torch.compile'd DDP model: the joined rank takes part in the calls the
    others announce, so none of them is a special case."""
    _check_against_reference([3, 1], variant)


def test_calls_that_change_after_a_rank_joined_are_shadowed():
    """Rank 0 calls one more layer at its last step, after the other joined: shadowed like any other."""
    _check_against_reference([3, 1], extra_at=2)


def test_a_new_joinable_for_each_join():
    _check_against_reference([3, 1], epochs=2)


def test_a_rank_without_any_batch_shadows_every_step():
    _check_against_reference([2, 0])


def _wrong_order(rank, world_size):
    model = distsync.convert_sync_batchnorm(_Net())
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    try:
        with Join([ddp, distsync.joinable(ddp)]):
            ddp(_batch(rank, 0).float()).sum().backward()
    except ValueError as error:
        return str(error)
    return None


def test_the_joinable_must_come_first():
    for message in run_world(_wrong_order, 2):
        assert message is not None and "must come first" in message


def _after_join(rank, world_size, throw):
    model = distsync.convert_sync_batchnorm(_Net())
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    layers = distsync.joinable(ddp)
    ref = weakref.ref(layers)
    try:
        with Join([layers, ddp], throw_on_early_termination=throw):
            for step in range(2 + rank):
                _loss(ddp(_batch(rank, step).float())).backward()
    except RuntimeError as error:
        assert throw and "exhausted" in str(error), error
    del layers
    gc.collect()
    model.eval()
    model(_batch(rank, 9).float())  # a validation forward after the Join
    best = copy.deepcopy(model)  # a best-model copy: nothing of the Join (a process group) is held
    buffer = io.BytesIO()
    torch.save(model, buffer)
    model.train()
    _loss(ddp(_batch(rank, 9).float())).backward()  # training goes on outside Join
    return ref() is None, type(best).__name__, buffer.tell() > 0


@pytest.mark.parametrize("throw", [False, True], ids=["joined", "throw_on_early_termination"])
def test_after_a_join_the_model_copies_pickles_and_the_joinable_is_freed(throw):
    for freed, name, saved in run_world(_after_join, 2, throw):
        assert name == "_Net" and saved
        assert freed or throw  # after an exception torch's Join runs no post-hook: freed at the next Join


def _collectives(rank, world_size, counts):
    """All-reduces per step of the synced layers, by the ranks still training."""
    with counted_all_reduces() as calls:
        _train(rank, world_size, counts)
    return len(calls)


def test_collectives_per_step_without_a_joined_rank_are_those_of_plain_training():
    even, uneven = run_world(_collectives, 2, [2, 2]), run_world(_collectives, 2, [2, 1])
    # 2 synced layers, one all-reduce each way: 4 per step (the CPU may merge a far mean again, alike)
    assert even[0] == even[1] and even[0] >= 2 * 4
    assert uneven[1] == uneven[0]  # the joined rank took part in each of rank 0's all-reduces
