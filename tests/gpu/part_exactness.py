"""Part 1: on the device, synchronized BN equals float64 ``nn.BatchNorm`` on the CPU over the global batch.

The cases of ``python -m distsync.check`` (float32/fp16/bf16, channels_last, uneven and empty per-rank
batches, momentum=None, affine=False, track_running_stats=False, eval mode; outputs, input and parameter
gradients, running statistics) in a one-process world and in two ranks sharing the GPU over gloo. NCCL
refuses two ranks on one device, so the 2-rank worlds here run gloo, which takes CUDA tensors: the layer's
CUDA kernels and device-side statistics are the same, only the transport differs. Then timm's EfficientNet-B0
(whose ``BatchNormAct2d`` is an ``nn.BatchNorm2d`` subclass), converted, two DDP training steps on uneven
per-rank batches against its float64 original on the CPU, as ``tests/test_models.py`` does on the CPU.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from common import Findings, quick, rank_device, relative_error
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import distsync
from distsync.check import Case, default_cases, run_case, tolerance
from distsync.testing import run_world

TIMM_MODEL = "efficientnet_b0"
TIMM_SIZES = (2, 5)  # per-rank batches, uneven
CLASSES = 5
# float64 on the device against float64 on the CPU: the same sums in another order (1e-9, as on the CPU);
# float32 forward (outputs, running statistics) without TF32: float32 rounding of a deep net (1e-4).
TIMM_TOLERANCE = {"float64": 1e-9, "float32": 1e-4}


def run(findings: Findings, device: str) -> None:
    if device == "cuda":
        findings.note(
            "2-rank worlds: gloo with both ranks on cuda:0 (NCCL refuses two ranks on one device); the "
            "layer's CUDA kernels and device-side statistics are those of an NCCL run"
        )
    for world_size in (1, 2):
        cases = default_cases(world_size)
        per_rank = run_world(_cases_on_rank, world_size, cases, device, timeout=120)
        for index, case in enumerate(cases):
            worst = max(max(errors[index].values(), default=0.0) for errors in per_rank)
            label = f"{world_size} rank{'s' if world_size > 1 else ''}: {case.describe()}"
            findings.within(label, worst, tolerance(case, world_size, device))
    sizes = (1, 2) if quick(device) else TIMM_SIZES
    per_rank = run_world(_timm_world, 2, sizes, device, timeout=180)
    for quantity in per_rank[0]:
        worst = max(errors[quantity] for errors in per_rank)
        limit = TIMM_TOLERANCE["float32" if quantity.startswith("float32") else "float64"]
        findings.within(f"{TIMM_MODEL} converted, 2 ranks {list(sizes)}: {quantity}", worst, limit)


def _cases_on_rank(rank: int, world_size: int, cases: list[Case], device: str) -> list[dict[str, float]]:
    place = str(rank_device(device, rank))
    return [run_case(case, rank, device=place) for case in cases]


def _build() -> nn.Module:
    """EfficientNet-B0, untrained, with random BN parameters and running statistics (so both are used)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(TIMM_MODEL, pretrained=False, num_classes=CLASSES)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.5, 0.5)
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model.train()


def _norm_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def _statistics_error(model: nn.Module, reference: nn.Module) -> float:
    worst, references = 0.0, _norm_layers(reference)
    for name, layer in _norm_layers(model).items():
        if int(layer.num_batches_tracked) != int(references[name].num_batches_tracked):
            return float("inf")
        for key in ("running_mean", "running_var"):
            worst = max(worst, relative_error(getattr(layer, key), getattr(references[name], key)))
    return worst


def _tensors_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """Worst relative error tensor by tensor; a tensor whose reference is far below its share of the whole
    (exactly zero in exact arithmetic, rounding noise in both) is measured against that share."""
    total = sum(e.numel() for e in expected)
    whole = torch.cat([e.detach().double().cpu().flatten() for e in expected]).norm().item()
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        e = e.detach().double().cpu()
        scale = max(e.norm().item(), whole * (e.numel() / total) ** 0.5, 1e-300)
        worst = max(worst, (a.detach().double().cpu() - e).norm().item() / scale)
    return worst


def _float32_errors(note, model32, reference, images, expected, rows: slice, place) -> None:
    """The float32 converted copy: its training forward (outputs, running statistics), then eval mode."""
    with torch.no_grad():
        note("float32 output", relative_error(model32(images[rows].float().to(place)), expected[rows]))
        note("float32 running statistics", _statistics_error(model32, reference))
        model32.eval(), reference.eval()
        expected_eval = reference(images)[rows]
        note("float32 eval output", relative_error(model32(images[rows].float().to(place)), expected_eval))
        reference.train()


def _timm_world(rank: int, world_size: int, sizes: tuple[int, ...], device: str) -> dict[str, float]:
    """Errors of this rank's converted models, on the device, against the float64 original on the CPU."""
    place = rank_device(device, rank)
    if place.type == "cuda":  # float32 compared at float32's own accuracy, not TF32's
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    original = _build()
    reference = copy.deepcopy(original).double()
    model32 = distsync.convert_sync_batchnorm(copy.deepcopy(original)).to(place)
    model = distsync.convert_sync_batchnorm(copy.deepcopy(reference)).to(place)
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    before = [p.detach().clone() for p in reference.parameters()]
    lo, hi, total = sum(sizes[:rank]), sum(sizes[: rank + 1]), sum(sizes)
    errors: dict[str, float] = {}

    def note(name: str, error: float) -> None:
        errors[name] = max(errors.get(name, 0.0), error)

    for step in range(2):
        gen = torch.Generator().manual_seed(step + 1)
        images = torch.randn(total, 3, 64, 64, generator=gen, dtype=torch.float64)
        projection = torch.randn(total, CLASSES, generator=gen, dtype=torch.float64)
        expected_x = images.clone().requires_grad_()
        expected = reference(expected_x)
        ((expected * projection).sum() / total).backward()
        if step == 0:  # the float32 copy is not trained: compared before the first update
            _float32_errors(note, model32, reference, images, expected, slice(lo, hi), place)
        x = images[lo:hi].to(place).requires_grad_()
        out = ddp(x)
        # DDP averages over ranks: this rank's share of the global mean loss, times the world size
        ((out * projection[lo:hi].to(place)).sum() * world_size / total).backward()
        distsync.check_sync()
        note("output", relative_error(out, expected[lo:hi]))
        note("input gradient", relative_error(x.grad, expected_x.grad[lo:hi] * world_size))
        grads = [p.grad for p in model.parameters()]  # averaged by DDP: the global batch's
        note("parameter gradient", _tensors_error(grads, [p.grad for p in reference.parameters()]))
        note("running statistics", _statistics_error(model, reference))
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    updates = [p.detach().cpu() - b for p, b in zip(model.parameters(), before, strict=True)]
    expected_updates = [p.detach() - b for p, b in zip(reference.parameters(), before, strict=True)]
    note("parameters after 2 steps (their updates)", _tensors_error(updates, expected_updates))
    model.eval(), reference.eval()
    with torch.no_grad():
        images = torch.randn(
            total, 3, 64, 64, generator=torch.Generator().manual_seed(99), dtype=torch.float64
        )
        note("eval output", relative_error(model(images[lo:hi].to(place)), reference(images)[lo:hi]))
    dist.barrier()
    return errors
