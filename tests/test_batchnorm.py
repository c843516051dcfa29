"""DistSyncBatchNorm equals float64 nn.BatchNorm on the concatenated global batch, in real gloo worlds."""

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distsync
from distsync._syncbn.payload import payload_size
from distsync.check import Case, default_cases, run_case, tolerance
from distsync.testing import allocations, run_world


def random_cases(world_size: int, count: int, seed: int) -> list[Case]:
    """A seeded sweep over input ranks, per-rank splits (empty ones included) and layer options."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        spatial = tuple(rng.randint(1, 4) for _ in range(rng.choice([0, 1, 2, 3])))
        sizes = tuple(rng.choice([0, 1, 2, 3, 5]) for _ in range(world_size))
        dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.float16, torch.bfloat16])
        half = dtype in (torch.float16, torch.bfloat16)
        if sum(sizes) * max(1, torch.Size(spatial).numel()) < 2:
            sizes = (2, *sizes[1:])
        cases.append(
            Case(
                sizes,
                shape=(rng.randint(1, 6), *spatial),
                dtype=dtype,
                channels_last=len(spatial) in (2, 3) and rng.random() < 0.3,
                momentum=rng.choice([0.1, 0.5, None]),
                affine=rng.random() < 0.7,
                track_running_stats=rng.random() < 0.8,
                generic_class=rng.random() < 0.3,
                offset=rng.choice([0.0, 0.0, 3.0]),
                steps=2,
                param_dtype=dtype if half and rng.random() < 0.5 else None,  # a half model or autocast
            )
        )
    return cases


def _run_cases(rank, world_size, cases):
    return [run_case(case, rank, seed=index) for index, case in enumerate(cases)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_batchnorm_on_global_batch(world_size):
    cases = default_cases(world_size) + random_cases(world_size, 24, seed=world_size)
    per_rank = run_world(_run_cases, world_size, cases)
    failures = []
    for index, case in enumerate(cases):
        for rank, errors in enumerate(per_rank):
            bad = {k: v for k, v in errors[index].items() if not v <= tolerance(case)}
            if bad:
                failures.append(f"rank {rank} {case.describe()}: {bad}")
    assert not failures, "\n".join(failures)


def test_hard_numerics_mean_far_from_zero():
    """float32 inputs whose mean is 1e4 times their std keep float32 accuracy (E[x^2]-E[x]^2 would not)."""
    case = Case((6, 2), shape=(8, 6, 6), offset=1e4)
    per_rank = run_world(_run_cases, 2, [case])
    worst = max(max(errors[0].values()) for errors in per_rank)
    assert worst < 1e-5


def _count_collectives(rank, world_size):
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        layer = distsync.DistSyncBatchNorm2d(16)
        x = torch.randn(4, 16, 5, 5, requires_grad=True)
        layer(x).sum().backward()
        train = list(calls)
        calls.clear()
        layer(torch.randn(4, 16, 5, 5)).sum()  # input needs no grad: no backward sync needed
        no_input_grad = list(calls)
        calls.clear()
        layer.eval()
        layer(x).sum().backward()
        return train, no_input_grad, list(calls)
    finally:
        dist.all_reduce = original


def test_one_all_reduce_per_direction_and_none_in_eval():
    for train, no_input_grad, evaluation in run_world(_count_collectives, 2):
        assert train == [payload_size(16) * 8] * 2  # forward + backward, O(C) float64
        assert no_input_grad == [payload_size(16) * 8]
        assert evaluation == []


def test_without_process_group_is_plain_batchnorm():
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(5)
    layer = distsync.DistSyncBatchNorm2d(5)
    layer.load_state_dict(reference.state_dict())
    for _ in range(2):
        x = torch.randn(3, 5, 4, 4)
        assert torch.equal(layer(x), reference(x))
    assert torch.equal(layer.running_var, reference.running_var)
    assert layer.num_batches_tracked == reference.num_batches_tracked == 2


def test_rank_checks_like_batchnorm():
    with pytest.raises(ValueError, match="expected 4D input"):
        distsync.DistSyncBatchNorm2d(3)(torch.randn(2, 3))
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        distsync.DistSyncBatchNorm1d(3)(torch.randn(2, 3, 2, 2))
    with pytest.raises(ValueError, match="at least 2D"):
        distsync.DistSyncBatchNorm(3)(torch.randn(3))
    assert distsync.DistSyncBatchNorm(3)(torch.randn(2, 3, 2, 2, 2, 2)).shape == (2, 3, 2, 2, 2, 2)


def _autocast_bf16(rank, world_size):
    torch.manual_seed(0)
    conv, layer = nn.Conv2d(3, 8, 3), distsync.DistSyncBatchNorm2d(8)
    x = torch.randn(4 * world_size, 3, 10, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = conv(x)
        out = layer(conv(x[rank * 4 : (rank + 1) * 4]))
    out.float().sum().backward()
    expected = nn.functional.batch_norm(hidden.double(), None, None, training=True)[rank * 4 : (rank + 1) * 4]
    return out.dtype, (out.double() - expected).abs().max().item(), layer.running_mean.dtype


def test_autocast_bf16_keeps_output_dtype_with_float32_statistics():
    for dtype, error, stats_dtype in run_world(_autocast_bf16, 2):
        assert dtype == torch.bfloat16 and stats_dtype == torch.float32
        assert error < 0.05  # bf16 output rounding on values of size ~3


def _largest_allocation(rank, world_size):
    """Per half dtype: the largest single allocation of a synced fwd+bwd, in activations' worth of bytes."""
    largest = {}
    for dtype in (torch.bfloat16, torch.float16):
        layer = distsync.DistSyncBatchNorm2d(16)  # float32 parameters and statistics, as under autocast
        x = torch.randn(8, 16, 16, 16, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)

        def step(layer=layer, x=x, grad=grad):
            layer(x).backward(grad)

        step()
        largest[str(dtype)] = max(size for _, size in allocations(step)) / (x.numel() * x.element_size())
    return largest


def test_half_inputs_make_no_float32_copy_of_the_activation():
    for largest in run_world(_largest_allocation, 2):
        for dtype, ratio in largest.items():
            assert ratio < 2, f"{dtype}: one allocation of {ratio:.2f}x the activation (a float32 copy is 2x)"


def _built_on_meta(kind: str) -> nn.Module:
    """A layer or model built on the meta device, then materialized on the CPU as FSDP2 and accelerate do."""
    torch.manual_seed(0)
    if kind == "device argument":
        model = distsync.DistSyncBatchNorm2d(4, momentum=None, device="meta")
    elif kind == "device context":
        with torch.device("meta"):
            model = distsync.DistSyncBatchNorm2d(4, momentum=None)
    else:
        with torch.device("meta"):
            model = distsync.convert_sync_batchnorm(nn.BatchNorm2d(4, momentum=None))
    model.to_empty(device="cpu")
    model.reset_parameters()
    return model


def _meta_layer_trains(rank, world_size, kind):
    layer = _built_on_meta(kind)
    x = torch.arange(24.0).view(3, 2, 2, 2).repeat(1, 2, 1, 1) + rank
    layer(x).sum().backward()
    return layer.running_mean, layer.running_var, layer._counters.calls.device.type


def test_dtype_conversions_leave_the_compiled_call_counters_on_the_modules_device():
    """``.half()``, ``.to(torch.bfloat16)`` and ``.float()`` of a model on a device (meta stands in for a GPU
    here) leave the counters of compiled calls where the module is; they followed where a conversion takes
    a CPU tensor, so a dtype conversion of a CUDA model moved them to the CPU. A layer with no tensors of
    its own, moved to meta and back, gets fresh counters where it goes."""
    layer = distsync.DistSyncBatchNorm2d(4).to("meta")
    for convert in (nn.Module.half, lambda module: module.to(torch.bfloat16), nn.Module.float):
        convert(layer)
        assert layer._counters.calls.device.type == layer.weight.device.type == "meta"
    bare = distsync.DistSyncBatchNorm2d(4, affine=False, track_running_stats=False).to("meta")
    assert bare._counters.calls.device.type == "meta"
    assert bare.cpu()._counters.calls.device.type == "cpu"


@pytest.mark.parametrize("kind", ["device argument", "device context", "converted"])
def test_a_layer_built_on_meta_materializes_and_syncs(kind):
    reference = nn.BatchNorm2d(4, momentum=None)
    reference(torch.cat([torch.arange(24.0).view(3, 2, 2, 2).repeat(1, 2, 1, 1) + r for r in range(2)]))
    for running_mean, running_var, device in run_world(_meta_layer_trains, 2, kind):
        torch.testing.assert_close(running_mean, reference.running_mean)
        torch.testing.assert_close(running_var, reference.running_var)
        assert device == "cpu"
