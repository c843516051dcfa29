"""Parts 2 and 3: a training step never waits for the GPU, and it can be captured in a CUDA graph.

Both run in a one-rank NCCL world whose synchronized layers take their whole synchronized path over it
(:class:`common.GroupOfOne`): NCCL's all-reduce is asynchronous and capturable, so what is measured is the
layer's own behaviour. ``nn.SyncBatchNorm`` takes its own synchronized path beside it
(:class:`common.TorchSyncPath`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import (
    Findings,
    GroupOfOne,
    TorchSyncPath,
    Twin,
    model_errors,
    one_rank_world,
    plain_convnet,
    relative_error,
    set_transport,
    small_convnet,
)
from torch import nn
from torch.profiler import ProfilerActivity, profile

import distsync

# CUDA runtime calls that block the host until the device has got somewhere
_SYNCHRONIZING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
STEPS_UNDER_ERROR_MODE = 20  # 5 synchronized layers x 2 directions x 20 > 2 x 8: the deferred reads run too


def _training_step(model: nn.Module, batch: int = 32) -> Callable[[], None]:
    x = torch.randn(batch, 3, 16, 16, device="cuda")
    labels = torch.randint(0, 10, (batch,), device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        F.cross_entropy(model(x), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _synchronizing_calls(step: Callable[[], None], steps: int) -> tuple[float, dict[str, int]]:
    """Synchronizing CUDA runtime calls per step, by any thread of the process (the profiler's runtime
    events); the one ``torch.cuda.synchronize()`` after the last step is not counted."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    found: dict[str, int] = {}
    for event in prof.events():
        if event.name in _SYNCHRONIZING:
            found[event.name] = found.get(event.name, 0) + 1
    found.pop("cudaDeviceSynchronize", None)  # ours, after the last step
    return sum(found.values()) / steps, found


def host_sync(findings: Findings, device: str) -> None:
    with one_rank_world(device):
        distsync_model = small_convnet().cuda()
        set_transport(distsync_model, GroupOfOne)
        torch_model = TorchSyncPath.convert(plain_convnet()).cuda()
        for name, model in (("distsync", distsync_model), ("nn.SyncBatchNorm", torch_model)):
            step = _training_step(model)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            per_step, calls = _synchronizing_calls(step, 5)
            findings.figure(f"{name}: synchronizing CUDA runtime calls per training step", per_step)
            findings.note(f"{name}: synchronizing calls in 5 steps: {calls or 'none'}")
        distsync.check_sync()
        findings.check(
            "distsync: no synchronizing CUDA runtime call in 5 profiled training steps",
            findings.figures["distsync: synchronizing CUDA runtime calls per training step"] == 0,
        )
        step = _training_step(distsync_model)
        step()
        distsync.check_sync()
        torch.cuda.set_sync_debug_mode("error")
        error = None
        try:
            for _ in range(STEPS_UNDER_ERROR_MODE):
                step()
        except RuntimeError as raised:
            error = str(raised).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        distsync.check_sync()
        findings.check(
            f"distsync: {STEPS_UNDER_ERROR_MODE} steps under torch.cuda.set_sync_debug_mode('error')",
            error is None,
            error or "no synchronizing operation",
        )


def cuda_graph(findings: Findings, device: str) -> None:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    with one_rank_world(device):
        graphed, eager = small_convnet().cuda(), small_convnet().cuda()
        for model in (graphed, eager):
            set_transport(model, GroupOfOne)
        inputs = [torch.randn(16, 3, 16, 16, device="cuda") * (1 + i) + i for i in range(6)]
        static_x = inputs[0].clone()

        def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            out = model(x)
            (out * out).sum().backward()
            return out

        side = torch.cuda.Stream()  # warm up on a side stream before capturing, as PyTorch requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x in inputs[:3]:
                static_x.copy_(x)
                step(graphed, static_x)
                step(eager, x)
        torch.cuda.current_stream().wait_stream(side)
        distsync.check_sync()
        for model in (graphed, eager):
            model.zero_grad(set_to_none=True)  # the captured backward allocates them in the graph's pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(graphed, static_x)
        worst: dict[str, float] = {}
        for x in inputs[3:]:
            static_x.copy_(x)
            graph.replay()
            eager.zero_grad(set_to_none=True)
            out = step(eager, x)
            found = {"output": relative_error(static_out, out), **model_errors(eager, graphed)}
            for key, value in found.items():
                worst[key] = max(worst.get(key, 0.0), value)
        torch.cuda.synchronize()
        findings.within("3 replays equal eager steps: outputs, gradients, buffers", max(worst.values()), 1e-6)
        findings.note("worst by quantity: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items() if v))
        counted = [int(m.num_batches_tracked) for m in graphed.modules() if isinstance(m, nn.BatchNorm2d)]
        findings.check(
            "num_batches_tracked counts 3 warm-up steps and 3 replays", set(counted) == {6}, str(counted)
        )
        try:
            distsync.check_sync()
            clean = None
        except distsync.SyncError as error:
            clean = str(error)
        findings.check("check_sync() after the replays: nothing to report", clean is None, clean or "")
        findings.check(*_planted_in_graph())


def _planted_in_graph() -> tuple[str, bool, str]:
    """A captured call whose peer (a :class:`common.Twin`) is out of step: the replay cannot raise (no host
    work during capture or replay), ``check_sync()`` after it must."""
    layer = distsync.DistSyncBatchNorm2d(4).cuda()
    layer._replica_reducer = Twin()
    x = torch.randn(8, 4, 3, 3, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer(x)
    torch.cuda.current_stream().wait_stream(side)
    distsync.check_sync()
    layer._replica_reducer = Twin(disagree_at=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x)
    graph.replay()
    torch.cuda.synchronize()
    try:
        distsync.check_sync()
    except distsync.SyncError as error:
        return "a planted out-of-step call in a graph: check_sync() after its replay raises", True, str(error)
    return (
        "a planted out-of-step call in a graph: check_sync() after its replay raises",
        False,
        "nothing raised",
    )
