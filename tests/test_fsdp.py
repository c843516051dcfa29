"""FSDP2 composition: a CNN with synced layers built on meta, converted, sharded with fully_shard."""

import pytest
import torch
from torch import nn

import distsync
from distsync.testing import run_world

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (torch >= 2.6)")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("needs FSDP2's fully_shard (torch >= 2.6)", allow_module_level=True)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4)
    )


def _batch(rank):
    return torch.randn(3 + rank, 3, 6, 6, generator=torch.Generator().manual_seed(rank))


def _sharded(rank, world_size, param_dtype):
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = distsync.convert_sync_batchnorm(_net())
    policy = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype)
    for layer in model:
        if isinstance(layer, nn.Conv2d):
            fsdp.fully_shard(layer, mp_policy=policy)
    fsdp.fully_shard(model, mp_policy=policy)
    model.to_empty(device="cpu")
    with torch.no_grad():  # the reference's weights, sharded where FSDP sharded them (the parameters)
        for value, full in zip(model.state_dict().values(), _net().state_dict().values(), strict=True):
            sharded = hasattr(value, "device_mesh")
            value.copy_(distribute_tensor(full, value.device_mesh, value.placements) if sharded else full)
    out = model(_batch(rank))
    out.float().square().sum().backward()
    return out.detach().float(), model[1].running_var.clone(), model[4].running_mean.clone()


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-mixed"])
def test_fully_shard_on_synced_layers_built_on_meta(param_dtype):
    reference = _net()
    expected = reference(torch.cat([_batch(r) for r in range(2)]))
    close = {"rtol": 1e-5, "atol": 1e-5} if param_dtype is None else {"rtol": 0.05, "atol": 0.05}
    results = run_world(_sharded, 2, param_dtype)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), expected.detach(), **close)
    for _, running_var, running_mean in results:
        torch.testing.assert_close(running_var, reference[1].running_var, **close)
        torch.testing.assert_close(running_mean, reference[4].running_mean, **close)
