"""Activation checkpointing: a recomputed synced layer reuses its call's statistics, bit for bit."""

import functools

import pytest
import torch
from bn_subclasses import ActNorm2d
from collective_count import counted_all_reduces
from cuda_emulation import cuda_path_on_cpu
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import distsync
from distsync.testing import run_world


class _Net(nn.Module):
    """conv, [BN, ReLU, conv, a BN called twice, a converted subclass] checkpointed, conv: the middle is
    recomputed."""

    def __init__(self, use_checkpoint, policy=None):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 4, 3)
        self.bn = distsync.DistSyncBatchNorm2d(4, momentum=None)
        self.conv = nn.Conv2d(4, 4, 1)
        self.shared = distsync.DistSyncBatchNorm2d(4)
        self.act = distsync.convert_sync_batchnorm(ActNorm2d(4, momentum=None))  # a converted subclass
        self.head = nn.Conv2d(4, 2, 1)
        self.use_checkpoint = use_checkpoint
        self.policy = policy  # selective activation checkpointing's (non-reentrant)

    def middle(self, x):
        x = self.shared(self.conv(torch.relu(self.bn(x))))
        return self.act(self.shared(x * 2 + 1))  # the same layer again, on other values

    def forward(self, x):
        x = self.stem(x)
        if self.policy is not None:
            contexts = functools.partial(
                torch.utils.checkpoint.create_selective_checkpoint_contexts, *self.policy
            )
            x = checkpoint(self.middle, x, use_reentrant=False, context_fn=contexts)
        elif self.use_checkpoint:
            x = checkpoint(self.middle, x, use_reentrant=self.use_checkpoint == "reentrant")
        else:
            x = self.middle(x)
        return self.head(x)


def _train_steps(run, model, rank, steps):
    """``steps`` steps of ``run`` (``model`` or its compiled form) on batches of the rank's own size: each
    step's output, input gradient and parameter gradients."""
    results = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x = (torch.randn(2 + rank, 3, 6, 6, generator=gen) * 3 + 1).requires_grad_()
        out = run(x)
        out.square().sum().backward()
        results.append([out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())])
        model.zero_grad()
    return results


def _steps(rank, world_size, use_checkpoint, cuda_path=False, steps=3, policy=None):
    if cuda_path:  # the CUDA path's code on CPU tensors: the recomputed call found on the "device"
        with cuda_path_on_cpu():
            return _steps(rank, world_size, use_checkpoint, False, steps, policy)
    with counted_all_reduces() as calls:
        model = _Net(use_checkpoint, _POLICIES[policy]() if policy else None)
        results = _train_steps(model, model, rank, steps)
        # ActNorm2d's own call counter counts the recomputation too, as its forward says: left out
        buffers = [b.clone() for name, b in model.named_buffers() if name != "act.calls"]
        return results, buffers, len(calls)


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


# --- selective activation checkpointing (eager): torch's dispatch modes cache or recompute each op ---------


def _policies():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten

    def fixed(policy):
        return lambda ctx, op, *args, **kwargs: policy

    def but_in_place(ctx, op, *args, **kwargs):  # torch's cache refuses in-place ops' outputs by default
        return CheckpointPolicy.PREFER_RECOMPUTE if op._schema.is_mutable else CheckpointPolicy.MUST_SAVE

    def by_name(ctx, op, *args, **kwargs):  # a callable policy answering with a bool (True: save)
        return "relu" in str(op) or "convolution" in str(op)

    return {
        "recompute all": lambda: (fixed(CheckpointPolicy.PREFER_RECOMPUTE),),
        # every op saved; the subclass's own counter updates (num_batches_tracked.add_) are in-place ops,
        # whose outputs torch's cache takes only so (nn.BatchNorm's own included)
        "save all": lambda: (fixed(CheckpointPolicy.MUST_SAVE), True),
        "save all but in-place": lambda: (but_in_place,),
        "mixed": lambda: ([aten.convolution.default, aten.mul.Tensor],),  # saved, the rest recomputed
        "callable": lambda: (by_name,),
    }


_POLICIES = _policies() if hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts") else {}
_SAC = pytest.mark.skipif(not _POLICIES, reason="selective activation checkpointing needs torch >= 2.5")


def _selective_runs(rank, world_size):
    """Plain steps and steps under each selective checkpointing policy, in one world (or process)."""
    return {policy: _steps(rank, world_size, bool(policy), policy=policy) for policy in (None, *_POLICIES)}


def _assert_selective_runs_equal_plain(runs):
    want_results, want_buffers, want_calls = runs[None]
    for policy in _POLICIES:
        results, buffers, calls = runs[policy]
        _assert_same_bits(results, want_results, policy)
        _assert_same_bits(buffers, want_buffers, policy)  # moved once per step, as without checkpointing
        assert calls == want_calls, policy


@_SAC
def test_selective_checkpointing_equals_plain_steps_bit_for_bit_on_one_process():
    """No process group: the layers are batch norm of their own batch, recomputed without moving the
    running statistics a second time (which nn.BatchNorm does under recomputing policies)."""
    _assert_selective_runs_equal_plain(_selective_runs(0, 1))


@_SAC
def test_selective_checkpointing_equals_plain_steps_bit_for_bit_on_two_ranks():
    for runs in run_world(_selective_runs, 2):
        _assert_selective_runs_equal_plain(runs)


# --- cases where matching a recomputed call by its input would pick the wrong call -------------------------

MODES = (False, "reentrant", "non-reentrant")


def _checkpointed(fn, mode, *args):
    if not mode:
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=mode == "reentrant")


def _twice_on_identical_inputs(rank, world_size, mode):
    """One layer twice in a block; on rank 0 both calls see bit-identical inputs, on rank 1 they do not."""
    torch.manual_seed(0)
    bn = distsync.DistSyncBatchNorm1d(4)
    x = torch.randn(3 + rank, 4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    z = x * 1 if rank == 0 else x * 2 + 1

    def block(x, z):
        return bn(x) * bn(z).exp()

    out = _checkpointed(block, mode, x, z)
    out.sum().backward()
    return [out.detach(), x.grad, bn.weight.grad, bn.running_mean, bn.running_var]


def _sequential_repeating_a_batch(rank, world_size, mode):
    """checkpoint_sequential over an MLP starting with BatchNorm1d; rank 0 trains on the same batch every
    step (its calls' inputs repeat from step to step), with SGD steps in between."""
    torch.manual_seed(0)
    model = distsync.convert_sync_batchnorm(
        nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 6), nn.ReLU(), nn.BatchNorm1d(6), nn.Linear(6, 2))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    for step in range(4):
        gen = torch.Generator().manual_seed(0 if rank == 0 else step + 1)
        x = torch.randn(4, 6, generator=gen).requires_grad_()
        if mode:
            out = checkpoint_sequential(model, 2, x, use_reentrant=mode == "reentrant")
        else:
            out = model(x)
        out.square().sum().backward()
        seen.append([out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())])
        optimizer.step()
        optimizer.zero_grad()
    return seen, [b.clone() for b in model.buffers()]


def _many_calls_one_empty_rank(rank, world_size, mode):
    """A block calling one layer 20 times; rank 1's batch is empty. Counts the all-reduces."""
    with counted_all_reduces() as calls:
        torch.manual_seed(0)
        bn, lin = distsync.DistSyncBatchNorm1d(5), nn.Linear(5, 5)

        def block(x):
            for _ in range(20):
                x = lin(bn(x)).tanh()
            return x

        x = torch.randn(0 if rank == 1 else 6, 5, generator=torch.Generator().manual_seed(3)).requires_grad_()
        out = _checkpointed(block, mode, x)
        out.sum().backward()
        return [out.detach(), x.grad, bn.weight.grad, lin.weight.grad, bn.running_var], len(calls)


def _per_mode(rank, world_size, case):
    return {mode: case(rank, world_size, mode) for mode in MODES}


def _assert_same_bits(got, want, label):
    if isinstance(got, (list, tuple)):
        assert len(got) == len(want), label
        for a, b in zip(got, want, strict=True):
            _assert_same_bits(a, b, label)
    elif isinstance(got, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=label)
    else:
        assert got == want, label


@pytest.mark.parametrize(
    "case", [_twice_on_identical_inputs, _sequential_repeating_a_batch, _many_calls_one_empty_rank]
)
def test_recomputed_calls_get_their_own_statistics_bit_for_bit(case):
    """Checkpointed equals plain, bit for bit, in both checkpoint modes (and as many all-reduces)."""
    for runs in run_world(_per_mode, 2, case):
        for mode in ("reentrant", "non-reentrant"):
            _assert_same_bits(runs[mode], runs[False], f"{case.__name__} {mode}")


class _Reversible(torch.autograd.Function):
    """A reversible block, y1 = x1 + f(x2), y2 = x2 + g(y1): its backward rebuilds the inputs by running
    f and g again (a forward inside a backward that is no checkpoint's recomputation)."""

    @staticmethod
    def forward(ctx, x1, x2, f, g, *params):
        ctx.f, ctx.g = f, g
        with torch.no_grad():
            y1 = x1 + f(x2)
            y2 = x2 + g(y1)
        ctx.save_for_backward(y1, y2)
        return y1, y2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        f, g = ctx.f, ctx.g
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = g(y1)
            x2 = (y2 - gy1).detach().requires_grad_()
            fx2 = f(x2)
        params = [*f.parameters(), *g.parameters()]
        dgy1 = torch.autograd.grad(gy1, [y1, *g.parameters()], dy2)
        dy1_total = dy1 + dgy1[0]
        dfx2 = torch.autograd.grad(fx2, [x2, *f.parameters()], dy1_total)
        grads = {p: None for p in params}
        for p, grad in zip(g.parameters(), dgy1[1:], strict=True):
            grads[p] = grad
        for p, grad in zip(f.parameters(), dfx2[1:], strict=True):
            grads[p] = grad
        return (dy1_total, dy2 + dfx2[0], None, None, *(grads[p] for p in params))


def _reversible_net(norm):
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(4, 4), norm(4), nn.Tanh())
    g = nn.Sequential(nn.Linear(4, 4), norm(4), nn.Tanh())
    return f.double(), g.double()


def _reversible_step(f, g, x1, x2):
    y1, y2 = _Reversible.apply(x1, x2, f, g, *f.parameters(), *g.parameters())
    (y1.sin() + y2.cos()).sum().backward()
    return [y1.detach(), y2.detach(), x1.grad, x2.grad, *(p.grad for p in [*f.parameters(), *g.parameters()])]


def _reversible_world(rank, world_size):
    f, g = (distsync.convert_sync_batchnorm(m) for m in _reversible_net(nn.BatchNorm1d))
    x = torch.randn(7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    rows = slice(0, 3) if rank == 0 else slice(3, 7)
    x1, x2 = (part[rows].clone().requires_grad_() for part in x.split(4, dim=1))
    seen = _reversible_step(f, g, x1, x2)
    for p in seen[4:]:
        torch.distributed.all_reduce(p)  # parameter gradients stay local: summed, as DDP would
    return seen, [b.clone() for b in [*f.buffers(), *g.buffers()]]


def test_a_forward_inside_a_custom_backward_is_an_ordinary_synchronized_call():
    """A reversible network rebuilds its activations in its backward: those calls all-reduce (as
    nn.SyncBatchNorm's do) and equal nn.BatchNorm on the global batch, outputs, gradients and running
    statistics (moved by both passes, as nn.BatchNorm's are)."""
    f, g = _reversible_net(nn.BatchNorm1d)
    x = torch.randn(7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x1, x2 = (part.clone().requires_grad_() for part in x.split(4, dim=1))
    want = _reversible_step(f, g, x1, x2)
    want_buffers = [b.clone() for b in [*f.buffers(), *g.buffers()]]
    for rank, (seen, buffers) in enumerate(run_world(_reversible_world, 2)):
        rows = slice(0, 3) if rank == 0 else slice(3, 7)
        for got, expected in zip(seen[:4], want[:4], strict=True):
            torch.testing.assert_close(got, expected[rows], rtol=1e-10, atol=1e-10)
        for got, expected in zip(seen[4:], want[4:], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        for got, expected in zip(buffers, want_buffers, strict=True):
            torch.testing.assert_close(got.to(expected.dtype), expected, rtol=1e-10, atol=1e-10)


def _compiled_selective_runs(rank, world_size):
    """Compiled steps, plain and under two selective checkpointing policies (the compiler's own recompute)."""
    runs = {}
    for policy in (None, "recompute all", "mixed"):
        torch.manual_seed(0)
        model = _Net(bool(policy), _POLICIES[policy]() if policy else None)
        compiled = torch.compile(model, backend="aot_eager")
        results = _train_steps(compiled, model, rank, 2)
        runs[policy] = results, [b.clone() for name, b in model.named_buffers() if name != "act.calls"]
    return runs


@_SAC
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's imports
def test_compiled_selective_checkpointing_equals_compiled_plain_steps():
    """Under torch.compile the partitioner recomputes by the policy (distsync logs nothing): equal to the
    compiled plain step to float32 rounding."""
    for runs in run_world(_compiled_selective_runs, 2, timeout=600):
        want_results, want_buffers = runs[None]
        for policy in ("recompute all", "mixed"):
            results, buffers = runs[policy]
            for got, want in zip(results, want_results, strict=True):
                for a, b in zip(got, want, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=policy)
            for a, b in zip(buffers, want_buffers, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=policy)
