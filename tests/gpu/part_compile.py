"""Part 4: ``torch.compile(fullgraph=True)`` of a converted model equals eager mode, in a 2-rank world.

Inductor generates the kernels (Triton on a GPU); the synchronized calls are traced whole, their all-reduces
functional collectives in the graph, so ``fullgraph=True`` compiles the model as one graph per direction or
raises. The dry run on the CPU traces the same graphs but runs them with ``aot_eager``: a cold inductor
build of C++ kernels takes over a minute there, and ``tests/test_compile.py`` already checks inductor on the
CPU. Both ranks share the GPU over gloo (see part 1). Compared over 3 training steps with an eager copy:
outputs, input and parameter gradients, running statistics and ``num_batches_tracked``.
"""

from __future__ import annotations

import time

import torch
from common import Findings, model_errors, quick, rank_device, relative_error, small_convnet

import distsync
from distsync.testing import run_world

STEPS = 3
TOLERANCE = 1e-4  # generated kernels sum in another order than the eager ones


def run(findings: Findings, device: str) -> None:
    per_rank = run_world(_compiled_vs_eager, 2, device, timeout=240)
    for rank, (worst, seconds, graphs) in enumerate(per_rank):
        findings.within(
            f"rank {rank}: {STEPS} compiled steps equal eager ones", max(worst.values()), TOLERANCE
        )
        findings.check(f"rank {rank}: fullgraph compiled", graphs >= 1, f"{graphs} graph(s)")
        findings.figure(f"rank {rank}: first compiled step (compile time), s", round(seconds, 1))
    findings.note(
        "worst by quantity (rank 0): " + ", ".join(f"{k} {v:.1e}" for k, v in per_rank[0][0].items())
    )


def _compiled_vs_eager(rank: int, world_size: int, device: str) -> tuple[dict[str, float], float, int]:
    place = rank_device(device, rank)
    if place.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    eager, compiled_model = small_convnet().to(place), small_convnet().to(place)
    backend = "aot_eager" if quick(device) else "inductor"
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(rank)
    worst: dict[str, float] = {}
    first_step = 0.0
    for step in range(STEPS):
        x = (torch.randn(6 + 3 * rank, 3, 16, 16, generator=gen) * 2 + 1).to(place)
        dy = torch.randn(x.shape[0], 10, generator=gen).to(place)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e = eager(xe)
        (out_e * dy).sum().backward()
        started = time.perf_counter()
        out_c = compiled(xc)
        (out_c * dy).sum().backward()
        distsync.check_sync()
        if step == 0:
            first_step = time.perf_counter() - started
        found = {"output": relative_error(out_c, out_e), "input grad": relative_error(xc.grad, xe.grad)}
        found.update(model_errors(eager, compiled_model))
        for key, value in found.items():
            worst[key] = max(worst.get(key, 0.0), value)
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return worst, first_step, graphs
