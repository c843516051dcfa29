"""Per-layer structure of the CUDA path, distsync vs nn.SyncBatchNorm, traced without a GPU.

    python benchmarks/cuda_trace.py        # needs a CUDA build of torch (no GPU): see docs/performance.md

Every figure comes from dispatching one forward and one backward on fake CUDA tensors in a fake 2-rank
NCCL world: ATen ops (views excluded), host syncs (a read of a device value raises under fake tensors and is
counted here instead), host<->device copies, passes over the activation, collectives and their bytes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

import distsync
from distsync._syncbn import health as _health
from distsync.testing.cuda_trace import fake_cuda_world, record

SHAPE = (16, 64, 32, 32)


def _layer(kind: str, momentum):
    if kind == "distsync":
        return distsync.DistSyncBatchNorm2d(SHAPE[1], momentum=momentum, device="cuda")
    return nn.SyncBatchNorm(SHAPE[1], momentum=momentum, device="cuda")


_HOST_SYNCS = (DataDependentOutputException, DynamicOutputShapeException)


def trace(kind: str, momentum=0.1, dtype=torch.float32) -> dict:
    """Forward and backward traces; a host sync ends the trace there and is reported by op."""
    _health._monitor.__init__()
    result = {}
    with fake_cuda_world(2):
        layer = _layer(kind, momentum)
        x = torch.randn(SHAPE, device="cuda", dtype=dtype).requires_grad_()
        if kind == "distsync":  # the first calls build the layer's device-side tail tables
            warm = layer(x.detach().requires_grad_())
            warm.grad_fn.apply(torch.randn_like(warm))
        try:
            with record(x.numel()) as result["forward"]:
                out = layer(x)
            dy = torch.randn_like(out)
            with record(x.numel()) as result["backward"]:
                out.grad_fn.apply(dy)
        except _HOST_SYNCS as error:
            result["sync"] = (
                f"host sync in {'backward' if 'backward' in result else 'forward'} at {error.func}"
            )
    _health._monitor.__init__()
    return result


def _collectives(trace) -> str:
    return " + ".join(f"{op.split('.')[1]} {size} B" for op, size in trace.collectives) or "none"


def _row(name: str, result: dict) -> str:
    cells = []
    for phase in ("forward", "backward"):
        t = result.get(phase)
        cells.append(
            ("-", "-", "-", "-")
            if t is None
            else (str(len(t.host_transfers)), str(len(t.ops)), str(t.activation_passes), _collectives(t))
        )
    (fc, fo, fp, fcol), (bc, bo, bp, bcol) = cells
    sync = result.get("sync", "none")
    return f"| {name} | {sync} | {fc} / {bc} | {fo} / {bo} | {fp} / {bp} | {fcol} | {bcol} |"


def main() -> None:
    if not torch.version.cuda:
        raise SystemExit("needs a CUDA build of torch (a GPU is not needed)")
    print(f"torch {torch.__version__}, fake 2-rank NCCL world, input {SHAPE}, one forward + one backward\n")
    print(
        "| layer | host syncs | host copies fwd / bwd | ATen ops fwd / bwd | activation passes fwd / bwd "
        "| forward collectives | backward collectives |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in ("distsync", "nn.SyncBatchNorm"):
        for momentum in (0.1, None):
            for dtype in (torch.float32, torch.bfloat16):
                name = f"{kind}, {str(dtype).removeprefix('torch.')}, momentum={momentum}"
                print(_row(name, trace(kind, momentum, dtype)))


if __name__ == "__main__":
    main()
