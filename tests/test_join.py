"""Uneven numbers of batches per rank under DDP's Join: a joined rank shadows the synced collectives.

Every case trains a model under ``Join`` on ranks with different numbers of batches and compares each step
with float64 ``nn.BatchNorm`` on the concatenated batches of the ranks that have one that step: outputs,
input and parameter gradients (averaged by DDP over the world), and the running statistics every rank ends
with (the joined ones followed).
"""

import collections
import copy
import dataclasses
import gc
import io
import weakref

import pytest
import torch
import torch.utils.checkpoint
from bn_subclasses import DualNorm2d, UncountedNorm2d
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


@dataclasses.dataclass
class _Output:
    """A model's output as a dataclass."""

    logits: torch.Tensor
    note: str = "out"


@dataclasses.dataclass
class _ModelOutput(collections.OrderedDict):
    """Hugging Face's ModelOutput form: a dataclass that is an OrderedDict of its fields that are set."""

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)


def _logits(output):
    return output.logits if isinstance(output, (_Output, _ModelOutput)) else output


_NORMS = {"subclass twice": _TwiceNorm, "advprop": DualNorm2d, "uncounted subclass": UncountedNorm2d}


def _tower():
    return nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2, affine=False))


class _Net(nn.Module):
    def __init__(self, variant="plain"):
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = _NORMS.get(variant, nn.BatchNorm2d)(4)
        self.head = nn.Conv2d(4, 2, 1)
        self.bn2 = nn.BatchNorm2d(2, momentum=None)
        self.tokens = _TokenNorm(2, affine=False)
        self.extra = nn.BatchNorm2d(2, affine=False)  # no parameters: DDP needs no find_unused_parameters
        if variant == "towers":  # converted one by one in _train: the same paths, '1', in both
            self.tower_a, self.tower_b = _tower(), _tower()
        self.use_extra = False

    def middle(self, x):
        if self.variant == "advprop":
            self.bn.aux = not self.bn.aux  # the domains alternate from call to call
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
        if self.variant == "towers":
            x = self.tower_b(self.tower_a(x) * 2)
        x = self.extra(x) if self.use_extra else x
        if self.variant == "dataclass":
            return _Output(x)
        return _ModelOutput(logits=x) if self.variant == "model output" else x


class _Criterion(nn.Module):
    """A loss with a synchronized layer of its own (a projection's batch norm): called outside the model."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(2, affine=False)

    def forward(self, out):
        return _loss(self.norm(out.mean((2, 3))) + out.sum((2, 3)))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(2 + rank, 3, 5, 5, generator=gen, dtype=torch.float64) * 2 + 1


def _loss(out):
    return (out * out.detach().sign()).sum()


def _buffers(*modules):
    return {f"{i}.{k}": v.clone() for i, module in enumerate(modules) for k, v in module.named_buffers()}


def _train(rank, world_size, counts, variant="plain", extra_at=None, epochs=1):
    model = distsync.convert_sync_batchnorm(_Net(variant))
    if variant == "towers":  # converted apart: their layers' paths are the same
        distsync.convert_sync_batchnorm(model.tower_a), distsync.convert_sync_batchnorm(model.tower_b)
    criterion = distsync.convert_sync_batchnorm(_Criterion()) if variant == "criterion" else _loss
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    forward = torch.compile(ddp, backend="aot_eager") if variant == "compiled" else ddp
    seen_inputs = []
    model.bn.register_forward_hook(lambda module, args, out: seen_inputs.append(args[0].shape[0]))
    others = (criterion,) if variant == "criterion" else ()
    layers = distsync.joinable(ddp, *others)
    results = []
    for epoch in range(epochs):
        if epoch:  # a new joinable for every Join, as the error messages' own recipe reads
            layers = distsync.joinable(ddp, *others)
        with Join([layers, ddp]):
            for step in range(counts[rank]):
                model.use_extra = step == extra_at
                x = _batch(rank, step + 10 * epoch).float().requires_grad_()
                out = _logits(forward(x))
                criterion(out).backward()
                results.append((out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
                model.zero_grad()
    buffers = _buffers(model, *others)
    return results, buffers, seen_inputs


def _reference(counts, variant="plain", extra_at=None, epochs=1):
    plain = variant in ("compiled", "criterion") or variant.startswith("checkpoint")
    model = _Net("plain" if plain else variant).double()
    criterion = _Criterion().double() if variant == "criterion" else _loss
    results, world_size = [], len(counts)
    for epoch in range(epochs):
        for step in range(max(counts)):
            model.use_extra = step == extra_at
            ranks = [r for r in range(world_size) if step < counts[r]]
            x = torch.cat([_batch(r, step + 10 * epoch) for r in ranks]).requires_grad_()
            out = _logits(model(x))
            criterion(out).backward()
            sizes = [2 + r for r in ranks]
            outs, grads = out.detach().split(sizes), x.grad.split(sizes)
            params = [p.grad.clone() / world_size for p in model.parameters()]  # DDP: averaged over the world
            results.append({r: (outs[i], grads[i], params) for i, r in enumerate(ranks)})
            model.zero_grad()
    buffers = _buffers(model, *((criterion,) if variant == "criterion" else ()))
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
        assert buffers.keys() == expected_buffers.keys()
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


@pytest.mark.parametrize("variant", ["dataclass", "model output"])
def test_a_model_returning_a_dataclass(variant):
    """The end of a step is found from the output's tensors, searched as DDP searches them."""
    _check_against_reference([3, 1], variant)


@pytest.mark.parametrize("variant", ["advprop", "uncounted subclass"])
def test_the_joined_rank_follows_what_each_subclass_call_did(variant):
    """AdvProp's second set of statistics (its own buffers, its own counter, alternating calls) and a
    subclass that never counts: the joined rank moves exactly the buffers each call moved."""
    _check_against_reference([3, 1], variant)
    _check_against_reference([2, 0], variant)


def test_separately_converted_towers_with_the_same_paths():
    """Called in the same order on every rank, as without Join: each call is told apart by its layer."""
    _check_against_reference([3, 1], "towers")


def test_a_synchronized_layer_in_the_loss_given_to_the_joinable():
    _check_against_reference([3, 1], "criterion")
    _check_against_reference([2, 0], "criterion")


def _loss_layer_not_given(rank, world_size, counts, given_but_called_first=False):
    model = distsync.convert_sync_batchnorm(_Net())
    criterion = distsync.convert_sync_batchnorm(_Criterion())
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    others = (criterion,) if given_but_called_first else ()
    try:
        with Join([distsync.joinable(ddp, *others), ddp]):
            for step in range(counts[rank]):
                if given_but_called_first:  # before the model's forward: outside a step
                    criterion(_batch(rank, step)[:, :2].float())
                criterion(ddp(_batch(rank, step).float())).backward()
    except (ValueError, distsync.SyncError) as error:
        return type(error).__name__, str(error)
    return None, ""


def test_a_given_layer_called_before_the_models_forward_raises_on_every_rank():
    for name, message in run_world(_loss_layer_not_given, 2, [3, 1], True, timeout=120):
        assert name == "ValueError" and "'norm' (DistSyncBatchNorm1d)" in message, message
        assert "called outside a step" in message, message


@pytest.mark.parametrize("counts", [[3, 1], [2, 0]], ids=["all-training", "one-joined"])
def test_a_synchronized_layer_outside_the_joinable_raises_on_every_rank(counts):
    outcomes = run_world(_loss_layer_not_given, 2, counts, timeout=120)
    training = [outcome for rank, outcome in enumerate(outcomes) if counts[rank]]
    for name, message in training:
        assert name == "ValueError" and "'norm' (DistSyncBatchNorm1d)" in message, message
        assert "_Criterion" in message and "distsync.joinable(ddp_model, criterion)" in message, message
    for name, message in (outcome for rank, outcome in enumerate(outcomes) if not counts[rank]):
        assert name == "SyncError" and "not in the modules given to distsync.joinable" in message, message


class _AttributeStatisticsNorm(nn.BatchNorm2d):
    """Running statistics kept in plain attributes, not buffers: nothing a joined rank could follow."""

    def __init__(self, num_features):
        super().__init__(num_features)
        self.mean_seen, self.var_seen = torch.zeros(num_features), torch.ones(num_features)

    def forward(self, x):
        return nn.functional.batch_norm(
            x, self.mean_seen, self.var_seen, self.weight, self.bias, self.training, 0.1, self.eps
        )


def _statistics_not_buffers(rank, world_size):
    model = _Net()
    model.bn = _AttributeStatisticsNorm(4)
    model = distsync.convert_sync_batchnorm(model)
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    done = 0
    try:
        with Join([distsync.joinable(ddp), ddp]):
            for step in range(2 - rank):
                _loss(ddp(_batch(rank, step).float())).backward()
                done += 1
    except (ValueError, distsync.SyncError) as error:
        return done, type(error).__name__, str(error)
    return done, None, ""


def test_statistics_a_joined_rank_cannot_follow_raise_on_every_rank():
    """Exact while every rank trains; once one has joined, the next call raises everywhere."""
    (done0, name0, message0), (done1, name1, message1) = run_world(_statistics_not_buffers, 2, timeout=120)
    assert (done0, done1) == (1, 1)
    assert name0 == "ValueError" and "'bn' (DistSync_AttributeStatisticsNorm)" in message0, message0
    assert name1 == "SyncError" and "not buffers of the layer" in message1, message1


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


def _train_with_zero(rank, world_size, counts):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = distsync.convert_sync_batchnorm(_Net())
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
    steps = []
    with Join([distsync.joinable(ddp), ddp, zero]):
        for step in range(counts[rank]):
            params = {name: p.detach().clone() for name, p in model.named_parameters()}
            out = ddp(_batch(rank, step).float())
            _loss(out).backward()
            zero.step()
            zero.zero_grad()
            steps.append((params, out.detach()))
    return steps, _buffers(model)


def test_zero_redundancy_optimizer_under_join():
    """What the parameters become is ZeRO's (its join hook steps the joined rank's shard with that rank's
    own gradients: docs/layer.md); what distsync owns is exact with it: each step's outputs are float64
    nn.BatchNorm's on the step's global batch, with the parameters the ranks hold at that step, and every
    rank's running statistics follow."""
    counts = [3, 1]
    per_rank = run_world(_train_with_zero, 2, counts, timeout=150)
    reference = _Net().double()
    for step in range(max(counts)):
        ranks = [r for r in range(len(counts)) if step < counts[r]]
        params = per_rank[ranks[0]][0][step][0]
        for r in ranks:  # ZeRO broadcasts each shard: every training rank holds the same parameters
            for name, value in per_rank[r][0][step][0].items():
                torch.testing.assert_close(value, params[name], rtol=0, atol=0)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(params[name])
        outs = reference(torch.cat([_batch(r, step) for r in ranks])).split([2 + r for r in ranks])
        for r, want in zip(ranks, outs, strict=True):
            torch.testing.assert_close(per_rank[r][0][step][1].double(), want, rtol=1e-4, atol=1e-4)
    want_buffers = _buffers(reference)
    for _, buffers in per_rank:
        for key, want in want_buffers.items():
            torch.testing.assert_close(buffers[key].to(want.dtype), want, rtol=1e-5, atol=1e-5, msg=key)
