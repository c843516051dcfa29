"""Part 6: speed, side by side in one run: per layer, and a ResNet-50 training step.

Per layer, forward + backward at the shapes of ``benchmarks/bench_syncbn.py`` (float32) and of ResNet-50's
BN layers at 224 px with 2, 8 and 64 samples per GPU (bf16 input, float32 parameters, as under autocast;
small per-GPU batches are where synchronized BN is used most, and where the host sets the step time):

- ``native``: ``nn.BatchNorm2d`` (cuDNN/ATen), no synchronization: the floor;
- ``distsync``: ``DistSyncBatchNorm2d`` taking its synchronized path over a one-rank NCCL group
  (:class:`common.GroupOfOne`): everything it adds to native BN, with an all-reduce that waits for nobody;
- ``nn.SyncBatchNorm``: its synchronized path over the same group (:class:`common.TorchSyncPath`).

Time per call (median of runs of back-to-back calls, the device drained around each run), the host's CPU
time per call (this thread), and CUDA kernels (and copies) per call from the profiler. Then the eager
ResNet-50 training step of part 8 (:func:`part_step.measure_steps`): batch 8 and 64, native BN, distsync and
``nn.SyncBatchNorm`` side by side.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from common import (
    Findings,
    GroupOfOne,
    TorchSyncPath,
    fmt,
    one_rank_world,
    quick,
    set_transport,
    time_per_call,
)
from part_step import measure_steps
from torch import nn
from torch.profiler import ProfilerActivity, profile

import distsync

BENCH_SHAPES = [(8, 64, 8, 8), (16, 64, 32, 32)]  # benchmarks/bench_syncbn.py's headline shapes
RESNET50_PLANES = [(64, 112, 112), (256, 56, 56), (512, 28, 28), (1024, 14, 14), (2048, 7, 7)]
RESNET50_SHAPES = [(batch, *plane) for batch in (2, 8, 64) for plane in RESNET50_PLANES]
VARIANTS = ("native", "distsync", "nn.SyncBatchNorm")


def _layer(variant: str, channels: int, device: str) -> nn.Module:
    if variant == "native":
        return nn.BatchNorm2d(channels).to(device)
    if variant == "distsync":
        layer = distsync.DistSyncBatchNorm2d(channels).to(device)
        set_transport(layer, GroupOfOne)
        return layer
    return TorchSyncPath.convert(nn.BatchNorm2d(channels)).to(device)


def _fwd_bwd(layer: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Callable[[], None]:
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=dtype)

    def call() -> None:
        layer(x).backward(grad)
        x.grad = layer.weight.grad = layer.bias.grad = None

    return call


def _device_ops_per_call(call: Callable[[], None], device: str, calls: int = 5) -> float:
    """CUDA kernels, copies and memsets per call, from the profiler's device-side events."""
    if device != "cuda":
        return float("nan")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    device_side = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(device_side) / calls


def _count(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.0f}"


def run(findings: Findings, device: str) -> None:
    small = quick(device)
    calls, repeats = (5, 3) if small else (20, 7)
    cases = [(s, torch.float32) for s in BENCH_SHAPES[: 1 if small else None]]
    cases += [(s, torch.bfloat16) for s in ([(4, 64, 16, 16)] if small else RESNET50_SHAPES)]
    rows = []
    with one_rank_world(device):
        for shape, dtype in cases:
            measured = {}
            for variant in VARIANTS:
                layer = _layer(variant, shape[1], device)
                call = _fwd_bwd(layer, shape, dtype, device)
                try:
                    for _ in range(3):
                        call()
                except (RuntimeError, ValueError, NotImplementedError) as error:
                    measured[variant] = (float("nan"), float("nan"), float("nan"))
                    findings.note(f"{variant} at {shape}: n/a ({str(error).splitlines()[0][:100]})")
                    continue
                wall, cpu = time_per_call(call, device, calls, repeats)
                measured[variant] = (wall, cpu, _device_ops_per_call(call, device))
            distsync.check_sync()
            findings.check(
                f"distsync and native BN measured at {shape} {dtype}",
                all(math.isfinite(v) for v in (*measured["native"][:2], *measured["distsync"][:2])),
            )
            ours, theirs = measured["distsync"][2], measured["nn.SyncBatchNorm"][2]
            if math.isfinite(ours) and math.isfinite(theirs):  # on a GPU, where both ran
                findings.check(
                    f"distsync launches no more device ops per call than nn.SyncBatchNorm at {shape}",
                    ours <= theirs,
                    f"{ours:.0f} vs {theirs:.0f}",
                )
            native = measured["native"][0]
            rows.append([
                f"{shape} {str(dtype).removeprefix('torch.')}",
                *(fmt(measured[v][0]) for v in VARIANTS),
                f"{measured['distsync'][0] / native:.2f}",
                f"{measured['nn.SyncBatchNorm'][0] / native:.2f}",
                *(fmt(measured[v][1]) for v in VARIANTS),
                *(_count(measured[v][2]) for v in VARIANTS),
            ])  # fmt: skip
            findings.figure(f"distsync / native, {shape} {dtype}", round(measured["distsync"][0] / native, 3))
            findings.figure(
                f"host CPU per call, distsync / nn.SyncBatchNorm, {shape} {dtype}",
                round(measured["distsync"][1] / measured["nn.SyncBatchNorm"][1], 3),
            )
        header = [
            "shape", "native", "distsync", "nn.SyncBatchNorm", "distsync / native", "SyncBN / native",
            "host CPU per call: native", "distsync", "SyncBN", "device ops: native", "distsync", "SyncBN",
        ]  # fmt: skip
        findings.table(
            f"One BN layer, forward + backward, one-rank group ({calls} calls x {repeats})", header, rows
        )
        measure_steps(findings, device, ("eager",), budget_s=60)  # compiled: part 8, a run of its own
