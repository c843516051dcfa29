"""Models from real libraries, converted by distsync, equal their originals on the global batch.

timm's EfficientNet-B0 and MobileNetV3 normalize with ``BatchNormAct2d``, an ``nn.BatchNorm2d`` subclass
whose forward also applies the activation held in its children; torchvision's ResNet-18 uses plain
``nn.BatchNorm2d``. In one process a converted model equals the original, in training and eval mode. In gloo
worlds with uneven per-rank batches (an empty one included), converted models on each rank's slice equal the
float64 original on the concatenated batch: a float32 copy's outputs and running statistics, and a float64
copy's outputs, input gradients, parameter gradients summed over ranks, every layer's running statistics, eval
outputs, and its parameters after a few SGD steps under DDP.
"""

from __future__ import annotations

import copy

import _vision
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel

import distsync
from distsync.testing import run_world

_vision.ensure_importable()  # before timm imports torchvision; workers run this too when they import us
torchvision = pytest.importorskip("torchvision", exc_type=ImportError)
timm = pytest.importorskip("timm", exc_type=ImportError)

SIZE = 64  # image side: the last stage of each model sees 2x2 positions per sample (1x1 at 32)
CLASSES = 5
TIMM_MODELS = ["efficientnet_b0", "mobilenetv3_small_100"]
MODELS = [*TIMM_MODELS, "resnet18"]
# Largest relative errors accepted against the float64 original, measured at most 1e-11 for the float64
# converted model and 7e-6 for the float32 one's forward (its outputs and running statistics), as for the
# float32 original on the global batch. Float32 gradients are not compared: in these ReLU/max-pool networks
# an activation that rounds to the other side of a kink changes a whole gradient, by 2e-2 for the float32
# original of resnet18 itself (and for the float64 one when its input moves by 1e-6). A lost activation is
# off by 2e-1 or more, each rank's own statistics (BN not synced) by 4e-2 or more.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def tolerance(quantity: str) -> float:
    return TOLERANCE[torch.float32 if quantity.startswith("float32") else torch.float64]


def build(name: str) -> nn.Module:
    """``name`` untrained, float32, in training mode, the same on every call and every rank.

    Its batch norms get random affine parameters and running statistics, so that using them is checked too.
    """
    torch.manual_seed(0)
    if name == "resnet18":
        model = torchvision.models.resnet18(num_classes=CLASSES)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=CLASSES)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.5, 0.5)
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model.train()


def batch(count: int, seed: int, size: int = SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 images, labels, and a random projection of the logits (the loss whose gradients we compare)."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(count, 3, size, size, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (count,), generator=gen)
    return images, labels, torch.randn(count, CLASSES, generator=gen, dtype=torch.float64)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm of the difference over the reference's norm (0 for an empty slice)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.numel() == 0:
        return 0.0
    difference = (actual.detach().double() - expected.detach()).norm().item()
    return difference / max(expected.detach().norm().item(), 1e-300)


def tensors_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """Worst :func:`relative_error` over a model's gradients (or parameter updates), tensor by tensor.

    A tensor whose reference is far smaller than its share of the whole is measured against that share
    instead: some gradients are exactly zero in exact arithmetic (the bias of a norm layer whose output goes
    through a convolution into another norm layer) and rounding noise in both.
    """
    total = sum(e.numel() for e in expected)
    whole = torch.cat([e.detach().flatten() for e in expected]).norm().item()
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        scale = max(e.detach().norm().item(), whole * (e.numel() / total) ** 0.5, 1e-300)
        worst = max(worst, (a.detach().double() - e.detach()).norm().item() / scale)
    return worst


def norm_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def statistics_error(model: nn.Module, reference: nn.Module) -> float:
    """Worst relative error of a layer's running mean or variance; raises if a layer counted other batches."""
    worst = 0.0
    references = norm_layers(reference)
    for name, layer in norm_layers(model).items():
        assert layer.num_batches_tracked == references[name].num_batches_tracked, name
        for key in ("running_mean", "running_var"):
            worst = max(worst, relative_error(getattr(layer, key), getattr(references[name], key)))
    return worst


# -- one process ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_converted_equals_original_in_one_process(name):
    close = TOLERANCE[torch.float32]  # the same computation, perhaps rounded in another order
    original = build(name)
    converted = distsync.convert_sync_batchnorm(copy.deepcopy(original))
    layers, originals = norm_layers(converted), norm_layers(original)
    assert layers.keys() == originals.keys()
    for key, layer in layers.items():
        assert isinstance(layer, distsync.DistSyncBatchNorm), key
        if type(originals[key]) is not nn.BatchNorm2d:  # a subclass stays one: its forward is kept
            assert isinstance(layer, type(originals[key])), key
    assert converted.state_dict().keys() == original.state_dict().keys()

    images = batch(4, seed=1)[0].float()
    with torch.no_grad():
        for step in range(2):  # training mode: batch statistics, running statistics updated
            assert relative_error(converted(images + step), original(images + step)) <= close
        assert statistics_error(converted, original) <= close
        assert all(m.num_batches_tracked == 2 for m in layers.values())
        converted.eval(), original.eval()
        assert relative_error(converted(images), original(images)) <= close

        reverted = distsync.revert_sync_batchnorm(converted)
        for key, layer in norm_layers(reverted).items():
            assert type(layer) is type(originals[key]), key
        assert relative_error(reverted(images), original(images)) <= close


# -- gloo worlds ---------------------------------------------------------------------------------------


def _world(
    rank: int, world_size: int, name: str, sizes: tuple[int, ...], size: int, steps: int
) -> dict[str, float]:
    """Worst relative errors of this rank's converted models against the float64 original, by quantity.

    A float32 and a float64 converted copy run one training forward on this rank's slice of the batch. The
    float64 copy also runs the backward, eval mode and ``steps`` DDP steps (see ``TOLERANCE`` for why its
    gradients are the ones compared).
    """
    original = build(name)
    reference = copy.deepcopy(original).double()
    model32 = distsync.convert_sync_batchnorm(original)
    model = distsync.convert_sync_batchnorm(copy.deepcopy(reference))
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    errors = {}

    # training mode: one forward, and the backward of a random projection of the logits
    images, _, projection = batch(sum(sizes), seed=1, size=size)
    expected_x = images.clone().requires_grad_()
    expected = reference(expected_x)
    (expected * projection).sum().backward()
    with torch.no_grad():
        errors["float32 output"] = relative_error(model32(images[lo:hi].float()), expected[lo:hi])
    errors["float32 running statistics"] = statistics_error(model32, reference)
    x = images[lo:hi].clone().requires_grad_()
    out = model(x)
    (out * projection[lo:hi]).sum().backward()
    errors["output"] = relative_error(out, expected[lo:hi])
    errors["input gradient"] = relative_error(x.grad, expected_x.grad[lo:hi])
    grads = [p.grad for p in model.parameters()]
    summed = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(summed)  # each rank's parameter gradient is its samples' share of the global one
    errors["parameter gradient"] = tensors_error(
        summed.split([g.numel() for g in grads]), [p.grad.flatten() for p in reference.parameters()]
    )
    errors["running statistics"] = statistics_error(model, reference)

    # eval mode: each rank's running statistics, no communication
    for module in (model32, model, reference):
        module.eval()
    with torch.no_grad():
        expected = reference(images)[lo:hi]
        errors["float32 eval output"] = relative_error(model32(images[lo:hi].float()), expected)
        errors["eval output"] = relative_error(model(images[lo:hi]), expected)
    model.train(), reference.train()

    # DDP steps on the global batch's mean loss (uneven batches: each rank's sum, rescaled)
    before = [p.detach().clone() for p in reference.parameters()]
    ddp = DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        images, labels, _ = batch(sum(sizes), seed=2 + step, size=size)
        optimizer.zero_grad(), expected_optimizer.zero_grad()
        loss = cross_entropy(ddp(images[lo:hi]), labels[lo:hi], reduction="sum")
        (loss * world_size / sum(sizes)).backward()
        cross_entropy(reference(images), labels).backward()
        optimizer.step(), expected_optimizer.step()
    errors["trained parameter change"] = tensors_error(
        [p - b for p, b in zip(model.parameters(), before, strict=True)],
        [p - b for p, b in zip(reference.parameters(), before, strict=True)],
    )
    errors["trained running statistics"] = statistics_error(model, reference)
    return errors


def check_world(name: str, sizes: tuple[int, ...], size: int = SIZE, steps: int = 2) -> None:
    failures = []
    for rank, errors in enumerate(run_world(_world, len(sizes), name, sizes, size, steps, timeout=300)):
        failures += [
            f"rank {rank} {key}: {error:.2e} > {tolerance(key):.0e}"
            for key, error in errors.items()
            if not error <= tolerance(key)
        ]
    assert not failures, f"{name} on batches {list(sizes)}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_uneven_batches_equal_float64_original(name):
    check_world(name, (3, 1))


def test_three_ranks_one_empty_equal_float64_original():
    """Rank 1 has no sample; rank 2 has one, which at 32x32 is one value per channel in the last stage (a
    batch that local batch norm refuses in training mode)."""
    check_world("mobilenetv3_small_100", (5, 0, 1), size=32)
