"""Converted batch-norm subclasses keep their own forward, with only the normalization synchronized."""

import copy
import io

import pytest
import torch
import torch.utils.checkpoint
from bn_subclasses import ActNorm2d, AtenNorm, OwnStatisticsNorm, SkipsEmptyNorm, SuperNorm1d, SyncNormAct
from torch import nn

import distsync
from distsync.testing import WorkerFailed, run_world


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3),
        ActNorm2d(6, momentum=None),
        nn.Conv2d(6, 5, 1),
        AtenNorm(5),
        SyncNormAct(5, eps=1e-3),
        nn.Flatten(2),  # (N, 5, L)
        SuperNorm1d(5, momentum=0.3),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand_like(p) * 0.5)
    return model


def _batch(sizes, rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(sizes[rank], 3, 6, 6, generator=gen, dtype=torch.float64) * 3 + 2


def test_converted_subclasses_keep_forward_state_and_class():
    original = _model()
    converted = distsync.convert_sync_batchnorm(copy.deepcopy(original))
    for before, after in zip(original, converted, strict=True):
        assert type(after) is type(before) or isinstance(after, (type(before), distsync.DistSyncBatchNorm))
    layer = converted[1]
    assert isinstance(layer, ActNorm2d) and isinstance(layer, distsync.DistSyncBatchNorm)
    assert type(layer).__name__ == "DistSyncActNorm2d"
    assert list(converted.state_dict()) == list(original.state_dict())  # its buffer and parameter kept
    assert isinstance(converted[4], SyncNormAct)
    for step in range(3):
        x = _batch([4], 0, step).float()
        torch.testing.assert_close(converted(x), original(x), rtol=0, atol=0)
        assert int(layer.calls) == step + 1
    for key, value in original.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[key], value, rtol=0, atol=0, msg=key)
    converted.eval(), original.eval()
    torch.testing.assert_close(converted(x), original(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="ActNorm2d expects 4D input"):  # its own input check is kept
        converted[1](torch.randn(2, 6))


def test_revert_gives_back_the_original_classes_with_the_same_tensors():
    original = _model()
    converted = distsync.convert_sync_batchnorm(copy.deepcopy(original))
    tensors = {name: t for name, t in converted.state_dict(keep_vars=True).items()}
    children = converted[1].act
    reverted = distsync.revert_sync_batchnorm(converted)
    assert [type(m) for m in reverted.modules()] == [type(m) for m in original.modules()]
    assert all(t is tensors[name] for name, t in reverted.state_dict(keep_vars=True).items())
    assert reverted[1].act is children
    assert not hasattr(reverted[1], "_sync_state") and not hasattr(reverted[1], "process_group")
    assert hasattr(reverted[4], "process_group")  # an nn.SyncBatchNorm attribute of its own


def test_pickled_and_copied_twins_stay_twins():
    converted = distsync.convert_sync_batchnorm(_model())
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(converted)
    x = _batch([3], 0, 0).float()
    for other in (loaded, copied):
        assert [type(m) for m in other.modules()] == [type(m) for m in converted.modules()]
        torch.testing.assert_close(other(x), converted(x), rtol=0, atol=0)
    assert copied[1]._sync_state.copies == 1 and loaded[1]._sync_state.copies == 0


def _train_against_reference(rank, world_size, sizes, steps):
    model = distsync.convert_sync_batchnorm(_model())
    results = []
    for step in range(steps):
        x = _batch(sizes, rank, step).float().requires_grad_()
        out = model(x)
        gen = torch.Generator().manual_seed(step)
        (
            out * torch.randn(sum(sizes), *out.shape[1:], generator=gen)[sum(sizes[:rank]) :][: sizes[rank]]
        ).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for grad in grads:
            torch.distributed.all_reduce(grad)
        results.append((out.detach(), x.grad, grads, [b.clone() for b in model.buffers()]))
        with torch.no_grad():
            for p, grad in zip(model.parameters(), grads, strict=True):
                p -= 0.05 * grad  # the global batch's gradient, as in the reference
                p.grad = None
    return results


def _reference(sizes, steps):
    model = _model().double()
    results = []
    for step in range(steps):
        x = torch.cat([_batch(sizes, r, step) for r in range(len(sizes))]).requires_grad_()
        out = model(x)
        gen = torch.Generator().manual_seed(step)
        (out * torch.randn(out.shape, generator=gen).double()).sum().backward()
        results.append(
            (out.detach(), x.grad, [p.grad.clone() for p in model.parameters()], list(model.buffers()))
        )
        results[-1] = (*results[-1][:3], [b.clone() for b in results[-1][3]])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None
    return results


@pytest.mark.parametrize("sizes", [[3, 1], [2, 0, 3]], ids=["2-ranks-uneven", "3-ranks-one-empty"])
def test_subclasses_in_a_world_equal_the_float64_original_on_the_global_batch(sizes):
    steps = 2
    expected = _reference(sizes, steps)
    per_rank = run_world(_train_against_reference, len(sizes), sizes, steps)
    for step in range(steps):
        out, x_grad, grads, buffers = expected[step]
        close = {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(torch.cat([r[step][0] for r in per_rank]).double(), out, **close)
        torch.testing.assert_close(torch.cat([r[step][1] for r in per_rank]).double(), x_grad, **close)
        for rank_result in per_rank:
            for got, want in zip(rank_result[step][2], grads, strict=True):
                torch.testing.assert_close(got.double(), want, **close)
            for got, want in zip(rank_result[step][3], buffers, strict=True):
                torch.testing.assert_close(got.to(want.dtype), want, **close)


def test_an_unsyncable_subclass_is_refused_in_one_process():
    layer = distsync.convert_sync_batchnorm(OwnStatisticsNorm(3))
    with pytest.raises(ValueError, match="OwnStatisticsNorm cannot be synchronized"):
        layer(torch.randn(4, 3, 2, 2))
    layer.eval()
    assert layer(torch.randn(4, 3, 2, 2)).shape == (4, 3, 2, 2)  # eval mode syncs nothing: it runs


def _refused(rank, world_size, cls, sizes):
    model = distsync.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(2, 3, 1), cls(3)))
    try:
        model(torch.randn(sizes[rank], 2, 3, 3))
    except (ValueError, distsync.SyncError) as error:
        return type(error).__name__, str(error)
    return None


def test_an_unsyncable_subclass_is_refused_on_every_rank():
    for name, message in run_world(_refused, 2, OwnStatisticsNorm, [2, 2]):
        assert name == "ValueError" and "OwnStatisticsNorm cannot be synchronized" in message


def _skips_empty(rank, world_size, mode):
    torch.manual_seed(0)
    model = distsync.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(2, 3, 1), SkipsEmptyNorm(3)))
    x = torch.randn([3, 0][rank], 2, 3, 3, generator=torch.Generator().manual_seed(7)).requires_grad_()
    if mode:
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=mode == "reentrant")
    else:
        out = model(x)
    (out * out.detach().sign()).sum().backward()
    layer = model[1]
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    stats = (layer.running_mean.clone(), layer.running_var.clone(), layer.num_batches_tracked)
    return out.detach(), grads, *stats


def _skips_empty_all_modes(rank, world_size):
    return [_skips_empty(rank, world_size, mode) for mode in (False, "reentrant", "non-reentrant")]


def test_a_rank_whose_forward_skips_batch_norm_for_an_empty_batch_still_takes_part():
    """One rank's forward makes no F.batch_norm call (an empty batch returned as is, detectron2 style): it
    takes part in the call with no samples, so every rank gets nn.BatchNorm's result on the global batch,
    checkpointed or not."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))
    x = torch.randn(3, 2, 3, 3, generator=torch.Generator().manual_seed(7)).requires_grad_()
    out = reference(x)
    (out * out.detach().sign()).sum().backward()
    bn = reference[1]
    for rank, runs in enumerate(run_world(_skips_empty_all_modes, 2)):
        for got_out, grads, mean, var, counted in runs:
            if rank == 0:
                torch.testing.assert_close(got_out, out.detach(), rtol=1e-5, atol=1e-5)
            else:
                assert got_out.shape == (0, 3, 3, 3)
            torch.testing.assert_close(mean, bn.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(var, bn.running_var, rtol=1e-5, atol=1e-6)
            assert int(counted) == 1
            if rank == 0:  # the empty rank's parameter gradients are zero, the others' those of the batch
                for got, param in zip(grads, reference.parameters(), strict=True):
                    torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=1e-5)


def _frozen_forward(rank, world_size):
    layer = distsync.convert_sync_batchnorm(_FrozenNorm(3))
    return layer(torch.randn(2 + rank, 3, 2, 2)).shape[0]


class _FrozenNorm(nn.BatchNorm2d):
    """Normalizes with its running statistics even in training: nothing to sync, nothing to refuse."""

    def forward(self, x):
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False)


def test_a_subclass_frozen_in_training_runs_without_syncing():
    assert run_world(_frozen_forward, 2) == [2, 3]


def test_world_failure_is_reported_not_hung():
    with pytest.raises(WorkerFailed):
        run_world(_refused, 2, "not a class", [1, 1], timeout=60)
