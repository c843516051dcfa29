"""Part 8 (its own run: ``--only step``): the whole ResNet-50 training step, eager and compiled, side by side.

One step (forward under bf16 autocast, channels_last, cross-entropy, backward, SGD) at batch 8 and 64 per GPU,
for three ways of normalizing, each measured the same way in one process:

- ``native``: torchvision's ResNet-50 as it is (``nn.BatchNorm2d``): the floor;
- ``distsync``: converted by :func:`distsync.convert_sync_batchnorm`, every layer taking its synchronized
  path over a one-rank NCCL group (:class:`common.GroupOfOne`);
- ``nn.SyncBatchNorm``: converted by torch, taking its synchronized path over the same group
  (:class:`common.TorchSyncPath`).

and three ways of running the model: eager, ``torch.compile`` (default mode) and
``torch.compile(mode="reduce-overhead")`` (CUDA graphs; on the CPU it is left out). Modes go first, then
batch sizes, then variants, so that a run cut short by the time budget still has whole comparisons; each
compile's first step (its compile time) is reported beside the step time. The dry run on the CPU runs a
small conv net at batch 4, eager and default-compiled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import GroupOfOne, TorchSyncPath, fmt, one_rank_world, quick, set_transport, time_per_call
from torch import nn

import distsync

VARIANTS = ("native", "distsync", "nn.SyncBatchNorm")
BUDGET_S = 390  # of the part's 420 s: what is left then is skipped with a note, not killed
CLASSES = 1000


def run(findings, device: str) -> None:
    small = quick(device)
    if small:
        findings.note("dry run on the CPU: a small conv net, no reduce-overhead (CUDA graphs)")
    modes = ("eager", "default") if small else ("eager", "default", "reduce-overhead")
    with one_rank_world(device):
        measure_steps(findings, device, modes, BUDGET_S if not small else 10 * BUDGET_S)
        distsync.check_sync()


def measure_steps(findings, device: str, modes: tuple[str, ...], budget_s: float) -> None:
    """One table per mode: every variant's step at each batch size, in the one-rank world running now."""
    small = quick(device)
    batches = (4,) if small else (8, 64)
    steps, repeats = (2, 2) if small else (10, 5)
    deadline = time.monotonic() + budget_s
    torch.backends.cudnn.benchmark = True
    for mode in modes:
        rows, measured = [], {}
        for batch in batches:
            for variant in VARIANTS:
                if time.monotonic() > deadline:
                    findings.note(f"{mode}, batch {batch}, {variant}: not measured (time budget spent)")
                    continue
                measured[batch, variant] = _measure(findings, device, small, mode, batch, variant, steps,
                                                    repeats)  # fmt: skip
            native = measured.get((batch, "native"), (math.nan,) * 3)[0]
            for variant in VARIANTS:
                wall, cpu, first = measured.get((batch, variant), (math.nan,) * 3)
                ratio = wall / native if math.isfinite(wall) and math.isfinite(native) else math.nan
                compile_s = "" if mode == "eager" or math.isnan(first) else f"{first:.1f} s"
                images = "n/a" if math.isnan(wall) else f"{batch / wall:.0f}"
                rows.append([batch, variant, fmt(wall), images, fmt(cpu), f"{ratio:.3f}", compile_s])
                if math.isfinite(ratio):
                    findings.figure(f"step {mode}, batch {batch}, {variant} / native", round(ratio, 3))
        findings.check(
            f"{mode}: distsync and native steps measured",
            all(math.isfinite(measured.get((b, v), (math.nan,))[0]) for b in batches[:1]
                for v in ("native", "distsync")),
        )  # fmt: skip
        findings.table(
            f"{'small conv net' if small else 'resnet50'} training step, {mode}"
            f"{'' if small else ', bf16 autocast, channels_last, 224 px, SGD'}",
            ["batch", "variant", "step", "images/s", "CPU per step", "/ native", "first step (compile)"],
            rows,
        )


def _measure(findings, device, small, mode, batch, variant, steps, repeats) -> tuple[float, float, float]:
    """(step wall s, step CPU s, first step s) of one variant in one mode; NaNs and a note if it fails."""
    try:
        step = _step(device, small, mode, batch, variant)
        started = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - started
        for _ in range(2):
            step()
        wall, cpu = time_per_call(step, device, steps, repeats)
        return wall, cpu, first
    except Exception as error:  # a variant that cannot run in this mode: reported, the others go on
        findings.note(f"{mode}, batch {batch}, {variant}: n/a ({str(error).strip().splitlines()[0][:160]})")
        return math.nan, math.nan, math.nan
    finally:
        torch._dynamo.reset()  # each compile starts from nothing: no cache shared between variants


def _step(device: str, small: bool, mode: str, batch: int, variant: str) -> Callable[[], None]:
    torch.manual_seed(0)
    if small:
        from common import plain_convnet

        model: nn.Module = nn.Sequential(plain_convnet(8), nn.Linear(10, CLASSES))
        size = 16
    else:
        import torchvision

        model, size = torchvision.models.resnet50(), 224
    if variant == "distsync":
        model = distsync.convert_sync_batchnorm(model)
        set_transport(model, GroupOfOne)
    elif variant == "nn.SyncBatchNorm":
        model = TorchSyncPath.convert(model)
    model = model.to(device, memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, CLASSES, (batch,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    forward = model if mode == "eager" else torch.compile(model, mode=None if mode == "default" else mode)
    dtype = torch.bfloat16

    def step() -> None:
        with torch.autocast(device, dtype=dtype):
            loss = F.cross_entropy(forward(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
