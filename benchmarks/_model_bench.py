"""A DDP training step of a small conv net: synced vs. local batch norm, memory, collectives, BN group."""

from __future__ import annotations

import functools
import importlib.util
import itertools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import Budget, device, median, median_ratio, ratio_quartiles, time_interleaved
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import distsync
from distsync._syncbn.payload import payload_size
from distsync.testing import allocations

BLOCKS, CHANNELS, SIZE, BATCH, CLASSES = 7, 32, 32, 16, 10


def conv_net() -> nn.Sequential:
    """7 conv-BN-ReLU blocks of 32 channels, global pooling and a linear head."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for block in range(BLOCKS):
        layers += [
            nn.Conv2d(3 if block == 0 else CHANNELS, CHANNELS, 3, padding=1, bias=False),
            nn.BatchNorm2d(CHANNELS),
            nn.ReLU(inplace=True),
        ]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, CLASSES))


def _add_bn_collectives(net: nn.Module) -> None:
    """Give every local BN the two all-reduces a synced one needs (one in forward, one in backward)."""

    payloads: dict[int, torch.Tensor] = {}

    def after_forward(module, inputs, output) -> None:
        width = module.num_features
        if width not in payloads:
            payloads[width] = torch.zeros(payload_size(width), dtype=torch.float64, device=device())
        payload = payloads[width]
        dist.all_reduce(payload)
        if output.requires_grad:
            output.register_hook(lambda _: dist.all_reduce(payload))

    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.register_forward_hook(after_forward)


def _fake_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of torchvision's FakeData (3x32x32 images, 10 classes), different on every rank."""
    from torchvision.datasets import FakeData
    from torchvision.transforms import ToTensor

    data = FakeData(BATCH, (3, SIZE, SIZE), CLASSES, ToTensor(), random_offset=BATCH * dist.get_rank())
    images, labels = zip(*(data[i] for i in range(BATCH)), strict=True)
    return torch.stack(images), torch.tensor(labels)


def _resnet18() -> nn.Module:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return resnet18(num_classes=CLASSES)


def _trainer(
    kind: str, build: Callable[[], nn.Module] = conv_net, fake_data: bool = False
) -> Callable[[], None]:
    """One training step (zero_grad, forward, loss, backward, SGD step) of the net with ``kind`` of BN."""
    dev = device()
    net = build()
    if kind in ("sync", "sync_group"):
        group = dist.new_group(backend="gloo") if kind == "sync_group" else None
        net = distsync.convert_sync_batchnorm(net, process_group=group)
    elif kind == "torch_syncbn":
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    elif kind == "floor":
        _add_bn_collectives(net)
    ddp_options = {} if kind == "local" else distsync.no_buffer_broadcast()
    model = DDP(net.to(dev), **ddp_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    if fake_data:
        x, y = (t.to(dev) for t in _fake_batch())
    else:
        x = torch.randn(BATCH, 3, SIZE, SIZE, generator=generator).to(dev)
        y = torch.randint(CLASSES, (BATCH,), generator=generator).to(dev)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def _peak_bytes(step: Callable[[], None]) -> int:
    """Peak of the bytes allocated during one step, above what was allocated before it (profiler events)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return max(itertools.accumulate((size for _, size in allocations(step)), initial=0))


def _saved_bytes(step: Callable[[], None]) -> int:
    """Bytes of the distinct storages autograd saved for backward during one step."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(storages.values())


def _count_collectives(step: Callable[[], None]) -> dict:
    """Python-level ``dist.all_reduce`` calls (the BN syncs) and all gloo all-reduces (DDP included)."""
    calls: list[int] = []
    original = dist.all_reduce

    @functools.wraps(original)
    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        dist.all_reduce = original
    gloo = sum(e.count for e in prof.key_averages() if e.key.startswith("gloo:all_reduce"))
    return {
        "bn_all_reduces_per_step": len(calls),
        "bn_layers": BLOCKS,
        "per_layer": len(calls) / BLOCKS,
        "payload_bytes": sorted(set(calls)),
        "gloo_all_reduces_per_step": gloo,
    }


def bench_model(budget: Budget, with_torch_syncbn: bool) -> dict:
    """Step times of every variant side by side, then memory and collectives of one step."""
    kinds = ["local", "local_nobcast", "floor", "sync", "sync_group"]
    kinds += ["torch_syncbn"] if with_torch_syncbn else []
    steps = {kind: _trainer(kind) for kind in kinds}
    times = time_interleaved(steps, budget)
    memory = {}
    for kind in ("local", "sync"):
        peak = torch.tensor([_peak_bytes(steps[kind]), _saved_bytes(steps[kind])], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        memory[kind] = {"peak_bytes": int(peak[0]), "saved_bytes": int(peak[1])}
    return {
        "median_s": {kind: median(t) for kind, t in times.items()},
        **{
            f"ratio_to_{base}": {kind: median_ratio(t, times[base]) for kind, t in times.items()}
            for base in ("local", "local_nobcast", "floor")
        },
        "group_vs_default_quartiles": ratio_quartiles(times["sync_group"], times["sync"]),
        # What each of the floor's added all-reduces costs inside the step: transport plus waiting for the
        # slower rank, which the compute between two syncs makes far longer than on idle ranks.
        "allreduce_in_step_s": median(
            (floor - plain) / (2 * BLOCKS)
            for floor, plain in zip(times["floor"], times["local_nobcast"], strict=True)
        ),
        "memory": memory,
        "collectives": _count_collectives(steps["sync"]),
        "times_s": times,
    }


def _torchvision_importable() -> bool:
    """Import torchvision here, through the tests' shim (``tests/_vision.py``) where the registry's build does
    not load its compiled ops beside this torch; False if it is not installed or still does not import."""
    shim = Path(__file__).resolve().parents[1] / "tests" / "_vision.py"
    if shim.exists():
        spec = importlib.util.spec_from_file_location("_vision", shim)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.ensure_importable()
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or a build that does not match this torch
        return False
    return True


def bench_resnet18(budget: Budget) -> dict | None:
    """torchvision's ResNet-18 on FakeData: distsync vs local BN vs the model floor (None without it)."""
    if not _torchvision_importable():
        return None
    kinds = ["local_nobcast", "floor", "sync"]
    steps = {kind: _trainer(kind, _resnet18, fake_data=True) for kind in kinds}
    times = time_interleaved(steps, budget)
    return {
        "median_s": {kind: median(t) for kind, t in times.items()},
        "ratio_to_floor": {kind: median_ratio(t, times["floor"]) for kind, t in times.items()},
        "ratio_to_local": {kind: median_ratio(t, times["local_nobcast"]) for kind, t in times.items()},
        "bn_layers": sum(isinstance(m, nn.BatchNorm2d) for m in _resnet18().modules()),
    }
