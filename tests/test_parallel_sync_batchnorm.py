"""Synchronized-BatchNorm's names: eps modes, patch_sync_batchnorm, vendored checkpoints, both-way loads."""

import pytest
import torch
from torch import nn

import distsync
from distsync.parallel import (
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    patch_sync_batchnorm,
    set_sbn_eps_mode,
)
from distsync.testing import run_world


def _eps_modes(rank, world_size):
    """Both modes in a synced 2-rank world, against their float64 definitions on the global batch."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(8, 3, 5, dtype=torch.float64, generator=gen)
    full[:, 0] *= 1e-4  # variance 1e-8, below eps: the modes differ here
    rows = slice(4 * rank, 4 * rank + 4)
    mean = full.mean((0, 2), keepdim=True)
    var = full.var((0, 2), unbiased=False, keepdim=True)
    errors = {}
    for mode, std in (("clamp", var.clamp(min=1e-5).sqrt()), ("plus", (var + 1e-5).sqrt())):
        set_sbn_eps_mode(mode)
        layer = SynchronizedBatchNorm1d(3, affine=False, dtype=torch.float64)
        out = layer(full[rows])
        expected = ((full - mean) / std)[rows]
        errors[mode] = ((out - expected).norm() / expected.norm()).item()
    set_sbn_eps_mode("clamp")
    return errors


def test_eps_modes_follow_the_switch_and_default_to_clamp():
    assert SynchronizedBatchNorm2d(3).eps_mode == "clamp"  # Synchronized-BatchNorm's default
    assert distsync.DistSyncBatchNorm2d(3).eps_mode == "plus"  # nn.BatchNorm's, untouched by the switch
    for errors in run_world(_eps_modes, 2):
        assert errors["clamp"] < 1e-12 and errors["plus"] < 1e-12, errors
    with pytest.raises(ValueError, match="unknown eps mode 'max'"):
        set_sbn_eps_mode("max")


def test_patch_sync_batchnorm_swaps_and_restores_even_on_error():
    original = nn.BatchNorm2d
    with patch_sync_batchnorm():
        assert isinstance(nn.Sequential(nn.BatchNorm2d(3))[0], SynchronizedBatchNorm2d)
    assert nn.BatchNorm2d is original
    with pytest.raises(RuntimeError), patch_sync_batchnorm():
        raise RuntimeError("model construction failed")
    assert nn.BatchNorm2d is original


def _vendored_state_dict(channels: int) -> dict:
    """A layer's state as CSAILVision's vendored copy saves it: extra buffers, no num_batches_tracked."""
    return {
        "weight": torch.rand(channels),
        "bias": torch.randn(channels),
        "running_mean": torch.randn(channels),
        "running_var": torch.rand(channels) + 0.5,
        "_tmp_running_mean": torch.randn(channels),
        "_tmp_running_var": torch.rand(channels),
        "_running_iter": torch.ones(1),
    }


@pytest.mark.parametrize("cls", [SynchronizedBatchNorm2d, distsync.DistSyncBatchNorm2d])
def test_vendored_checkpoints_load_strictly_with_a_note(cls):
    model = nn.Sequential(cls(4), nn.ReLU(), cls(4))
    state = {f"{i}.{k}": v for i in (0, 2) for k, v in _vendored_state_dict(4).items()}
    with pytest.warns(UserWarning, match="dropped its _tmp_running_mean, _tmp_running_var, _running_iter"):
        model.load_state_dict(state, strict=True)
    assert torch.equal(model[2].running_var, state["2.running_var"])
    assert int(model[0].num_batches_tracked) == 0


@pytest.mark.parametrize("other", [nn.BatchNorm2d, nn.SyncBatchNorm])
def test_checkpoints_load_both_ways_strictly(other):
    alias, plain = SynchronizedBatchNorm2d(3), other(3)
    for layer in (alias, plain):
        for tensor in layer.state_dict().values():
            tensor.copy_(torch.rand(tensor.shape) * 5)
    plain.load_state_dict(alias.state_dict(), strict=True)
    pairs = zip(alias.state_dict().values(), plain.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    other(3).load_state_dict(SynchronizedBatchNorm2d(3).state_dict(), strict=True)
    SynchronizedBatchNorm2d(3).load_state_dict(plain.state_dict(), strict=True)
