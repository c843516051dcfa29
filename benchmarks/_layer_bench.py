"""One BN layer, forward + backward: distsync vs. native BN vs. the floor (native BN + 2 all-reduces)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _harness import Budget, device, median, median_ratio, sync_device, time_interleaved
from torch import nn
from torch.profiler import ProfilerActivity, profile

from distsync import DistSyncBatchNorm2d
from distsync._syncbn.payload import payload_size
from distsync.testing import allocations

Shape = tuple[int, int, int, int]
OVERHEAD_SHAPE: Shape = (2, 8, 2, 2)


class _NoCommReducer:
    """A reducer for one participant: distsync's own compute, without any communication."""

    world_size, first = 1, True

    def all_reduce(self, payload: torch.Tensor) -> torch.Tensor:
        return payload

    def announce(self, call) -> None:  # nobody joined to tell
        pass


def _no_comm_layer(channels: int, dev: torch.device) -> nn.Module:
    layer = DistSyncBatchNorm2d(channels).to(dev)
    layer._replica_reducer = _NoCommReducer()  # the transport hook the replica path uses
    return layer


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, between: Callable | None = None):
    def run() -> None:
        out = layer(x)
        if between is not None:
            between()
        out.backward(grad)
        if between is not None:
            between()
        x.grad = layer.weight.grad = layer.bias.grad = None

    return run


def torch_syncbn_status() -> str | None:
    """None when ``nn.SyncBatchNorm`` trains on this device, else why not (its own error message)."""
    layer = nn.SyncBatchNorm(4).to(device())
    try:
        layer(torch.randn(2, 4, 2, 2, device=device())).sum().backward()
    except (ValueError, RuntimeError) as error:
        return f"n/a: refuses {device().type.upper()}: {str(error).splitlines()[0]}"
    return None


def layer_variants(
    shape: Shape, with_torch_syncbn: bool = False, dtype: torch.dtype = torch.float32
) -> dict[str, Callable[[], None]]:
    """The timed variants for one input shape; all of them run the same local batch.

    Parameters and statistics stay float32 whatever the input ``dtype``, as under autocast.
    """
    dev = device()
    channels = shape[1]
    x = torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, device=dev, dtype=dtype)
    payload = torch.zeros(payload_size(channels), dtype=torch.float64, device=dev)
    local = nn.BatchNorm2d(channels).to(dev)

    def all_reduce() -> None:
        dist.all_reduce(payload)

    def all_reduce_x2() -> None:
        all_reduce()
        all_reduce()

    variants = {
        "sync": _fwd_bwd(DistSyncBatchNorm2d(channels).to(dev), x, grad),
        "floor": _fwd_bwd(local, x, grad, between=all_reduce),
        "local": _fwd_bwd(local, x, grad),
        "sync_nocomm": _fwd_bwd(_no_comm_layer(channels, dev), x, grad),
        "allreduce_x2": all_reduce_x2,
    }
    if with_torch_syncbn:
        variants["torch_syncbn"] = _fwd_bwd(nn.SyncBatchNorm(channels).to(dev), x, grad)
    return variants


def bench_shape(
    shape: Shape, budget: Budget, with_torch_syncbn: bool, dtype: torch.dtype = torch.float32
) -> dict:
    """Median seconds per fwd+bwd of each variant, and the ratios to the floor."""
    variants = layer_variants(shape, with_torch_syncbn, dtype)
    times = time_interleaved(variants, budget)
    result = {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "median_s": {name: median(t) for name, t in times.items()},
    }
    result["ratio_to_floor"] = {
        name: median_ratio(t, times["floor"]) for name, t in times.items() if name in ("sync", "torch_syncbn")
    }
    result["nocomm_ratio_to_local"] = median_ratio(times["sync_nocomm"], times["local"])
    result["times_s"] = times
    return result


def half_memory(shape: Shape, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Largest single allocation and peak bytes of one fwd+bwd on a half input, distsync vs. native BN.

    In units of the half activation's bytes: a float32 copy of the activation would show as 2.
    """
    variants = layer_variants(shape, dtype=dtype)
    activation = torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
    result = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    for name in ("sync_nocomm", "local"):
        variants[name]()
        sizes = [size for _, size in allocations(variants[name])]
        result[name] = {
            "largest_allocation": max(sizes) / activation,
            "peak": max(itertools.accumulate(sizes)) / activation,
        }
    return result


def bench_layers(
    shapes: list[Shape], sweeps: dict[str, list[Shape]], budget: Budget, sweep_budget: Budget
) -> dict:
    """The headline shapes (float32, then the last one in bfloat16), then the sweeps drawn in the plot."""
    status = torch_syncbn_status()
    return {
        "torch_syncbn": status,
        "overhead": bench_shape(OVERHEAD_SHAPE, budget, status is None),
        "shapes": [bench_shape(shape, budget, status is None) for shape in shapes]
        + [bench_shape(shapes[-1], budget, status is None, torch.bfloat16)],
        "half_memory": half_memory(shapes[-1]),
        "sweeps": {
            axis: [bench_shape(shape, sweep_budget, status is None) for shape in sweep]
            for axis, sweep in sweeps.items()
        },
    }


def allreduce_latency(channels: int, calls: int = 400) -> dict:
    """Quantiles of one all_reduce of a float64 sync payload (2C+15, size class), back to back on idle ranks.

    The slowest rank's time per call. Set against the floor's cost per all_reduce inside a training step,
    it shows how much of that cost is the transport itself.
    """
    payload = torch.zeros(payload_size(channels), dtype=torch.float64, device=device())
    for _ in range(20):
        dist.all_reduce(payload)
    times = torch.zeros(calls, dtype=torch.float64)
    dist.barrier()
    for call in range(calls):
        start = time.perf_counter()
        dist.all_reduce(payload)
        sync_device()
        times[call] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    levels = (0.5, 0.75, 0.9)
    quantiles = torch.quantile(times, torch.tensor(levels, dtype=torch.float64)).tolist()
    named = {f"p{round(level * 100)}_s": value for level, value in zip(levels, quantiles, strict=True)}
    return {"channels": channels, "mean_s": times.mean().item(), **named}


def profile_layer(shape: Shape, calls: int = 200, top: int = 16) -> str:
    """Profiler table (self CPU time) of ``calls`` fwd+bwd of the distsync layer without communication.

    Without communication, so that waiting for the other rank (counted as the autograd Function's self
    time) does not hide the ops distsync adds on top of native batch norm.
    """
    run = layer_variants(shape)["sync_nocomm"]
    for _ in range(10):
        run()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)
