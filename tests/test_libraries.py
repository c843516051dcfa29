"""distsync where users are: the libraries a synchronized model meets, each against the plain model.

torchmetrics metrics held by the model, MONAI's ``MetaTensor`` batches through networks with in-place
activations, ``torch.fx`` tracing (torchvision's ``create_feature_extractor``, timm's feature graphs),
mmengine's name-matched weight init, and the warning for a model that no data-parallel wrapper drives.
"""

import copy

import _vision
import pytest
import torch
import torch.fx
from bn_subclasses import ReluNorm2d
from torch import nn

import distsync
from distsync.testing import run_world

_vision.ensure_importable()  # for the workers too: torchmetrics and timm import torchvision


def test_a_model_holding_a_torchmetrics_metric_converts_and_trains():
    torchmetrics = pytest.importorskip("torchmetrics")

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
            self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    model = Classifier()
    model.net(torch.randn(2, 3, 2, 2))  # initializes the lazy head
    converted = distsync.convert_sync_batchnorm(model)  # a Metric's __eq__ builds metrics: never called
    assert isinstance(converted.net[1], distsync.DistSyncBatchNorm2d)
    converted.accuracy.update(converted.net(torch.randn(4, 3, 2, 2)), torch.tensor([0, 1, 2, 0]))
    converted.accuracy.reset()  # changes Metric.__hash__: nothing keyed by it
    copy.deepcopy(converted)
    assert run_world(_metric_world, 2) == [True, True]


def _metric_world(rank, world_size):
    import torchmetrics

    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1))
            self.metric = torchmetrics.MeanSquaredError()

        def forward(self, x):
            return self.net(x).flatten(1)

    torch.manual_seed(0)
    model = distsync.convert_sync_batchnorm(Regressor())
    ddp = nn.parallel.DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    out = ddp(torch.randn(2 + rank, 3, 4, 4))
    out.sum().backward()
    model.metric.update(out.detach(), torch.zeros_like(out))
    return bool(torch.isfinite(model.metric.compute()))


def _monai_world(rank, world_size, network, sizes):
    """A MONAI network on MetaTensor batches, synchronized, against the plain network on the global batch."""
    from monai.data import MetaTensor

    torch.manual_seed(0)
    plain = _monai_network(network).double()
    synced = distsync.convert_sync_batchnorm(copy.deepcopy(plain))
    x = torch.randn(sum(sizes), 1, 16, 16, 16, dtype=torch.float64)
    weights = torch.randn(sum(sizes), 2, 16, 16, 16, dtype=torch.float64)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    affine = torch.diag(torch.tensor([2.0, 2.0, 2.0, 1.0], dtype=torch.float64))
    local = MetaTensor(x[rows].clone(), affine=affine).requires_grad_()
    out = synced(local)
    (out * weights[rows]).sum().backward()
    reference_in = MetaTensor(x.clone(), affine=affine).requires_grad_()
    reference = plain(reference_in)
    (reference * weights).sum().backward()
    grads = [p.grad.clone() for p in synced.parameters()]
    reference_params = list(plain.parameters())
    assert len(grads) == len(reference_params)
    for grad in grads:  # the layer keeps parameter gradients local, as a DDP model would average them
        torch.distributed.all_reduce(grad)
    pairs = zip(synced.buffers(), plain.buffers(), strict=True)
    buffers = [(a, b) for a, b in pairs if a.is_floating_point()]
    return {
        "type": type(out).__name__,
        "affine kept": bool(torch.equal(out.affine, affine)),
        "output": (out.as_tensor() - reference.as_tensor()[rows]).abs().max().item(),
        "input grad": (local.grad - reference_in.grad[rows]).abs().max().item(),
        "param grads": max(_max_error(a, p.grad) for a, p in zip(grads, reference_params, strict=True)),
        "running stats": max((a - b).abs().max().item() for a, b in buffers),
    }


def _max_error(a, b):
    return (a - b).abs().max().item()


def _monai_network(name):
    from monai.networks.nets import BasicUNet, DynUNet

    if name == "BasicUNet":  # LeakyReLU(inplace=True) after every batch norm
        features = (4, 4, 4, 4, 4, 4)
        return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=features, norm="batch")
    return DynUNet(  # batch norm, then an in-place LeakyReLU, in every block
        spatial_dims=3,
        in_channels=1,
        out_channels=2,
        kernel_size=[3, 3, 3],
        strides=[1, 2, 2],
        upsample_kernel_size=[2, 2],
        filters=[4, 8, 8],
        norm_name="batch",
    )


@pytest.mark.parametrize("network", ["BasicUNet", "DynUNet"])
def test_monai_metatensor_batches_with_in_place_activations_are_exact(network):
    pytest.importorskip("monai")
    for seen in run_world(_monai_world, 2, network, [1, 3]):
        assert seen["type"] == "MetaTensor" and seen["affine kept"]
        for key in ("output", "input grad", "param grads", "running stats"):
            assert seen[key] < 1e-9, (network, key, seen[key])


def _resnet18():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def test_fx_traces_a_converted_model_like_the_original():
    pytest.importorskip("torchvision")
    plain = _resnet18().eval()
    converted = distsync.convert_sync_batchnorm(copy.deepcopy(plain))
    x = torch.randn(2, 3, 32, 32)
    for mode in ("eval", "train"):
        traced = torch.fx.symbolic_trace(getattr(converted, mode)())
        original = torch.fx.symbolic_trace(getattr(plain, mode)())
        calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
        assert calls == [n.target for n in original.graph.nodes if n.op == "call_module"]
        assert isinstance(traced.get_submodule("bn1"), distsync.DistSyncBatchNorm2d)
        torch.testing.assert_close(traced(x), getattr(plain, mode)()(x), rtol=1e-5, atol=1e-5)


def _feature_world(rank, world_size):
    from torchvision.models.feature_extraction import create_feature_extractor

    model = distsync.convert_sync_batchnorm(_resnet18())
    extractor = create_feature_extractor(model, return_nodes={"layer1": "low", "layer4": "high"})
    torch.manual_seed(rank)
    x = torch.randn(2 + rank, 3, 32, 32)
    features = extractor(x)
    reference = copy.deepcopy(model)  # the same layers called directly: synchronized the same way
    stem = reference.maxpool(reference.relu(reference.bn1(reference.conv1(x))))
    return (features["low"] - reference.layer1(stem)).abs().max().item()


def test_create_feature_extractor_on_a_converted_model_stays_synchronized():
    pytest.importorskip("torchvision")
    for error in run_world(_feature_world, 2):
        assert error < 1e-5


def test_timm_feature_graph_of_a_converted_model():
    timm = pytest.importorskip("timm")
    from timm.models import FeatureGraphNet

    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False).eval()
    converted = distsync.convert_sync_batchnorm(copy.deepcopy(model))
    features = FeatureGraphNet(converted, out_indices=(1, 2))
    expected = FeatureGraphNet(model, out_indices=(1, 2))
    x = torch.randn(2, 3, 64, 64)
    for got, want in zip(features(x), expected(x), strict=True):
        torch.testing.assert_close(got, want)


def test_mmengine_init_cfg_matches_converted_layers_as_it_matches_the_originals():
    mmengine_model = pytest.importorskip("mmengine.model")

    class Net(mmengine_model.BaseModule):
        def __init__(self):
            init = [dict(type="Constant", layer=["_BatchNorm"], val=2.0, bias=0.5)]
            super().__init__(init_cfg=init)
            self.block = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.BatchNorm1d(4))
            self.head = nn.SyncBatchNorm(4)

    plain, converted = Net(), distsync.convert_sync_batchnorm(Net())
    for model in (plain, converted):
        model.init_weights()
    for name, layer in converted.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            original = plain.get_submodule(name)
            assert torch.equal(layer.weight, original.weight) and torch.equal(layer.bias, original.bias)
            assert layer.weight.eq(2.0).all(), name


class _Mixin:
    pass


class _OwnBN(nn.BatchNorm2d):
    pass


class _SubOwnBN(_OwnBN):
    pass


class _MixedBN(_Mixin, nn.BatchNorm2d):
    pass


class _DirectBN(nn.modules.batchnorm._BatchNorm):
    def _check_input_dim(self, input):
        pass


@pytest.mark.parametrize(
    "layer", ["BatchNorm2d", "_BatchNorm", "_OwnBN", "_SubOwnBN", "_Mixin", "ReluNorm2d"]
)
def test_mmengine_init_cfg_by_type_reaches_converted_subclasses_as_it_reaches_the_originals(layer):
    """mmengine matches a layer by the names of its class and of that class's direct bases."""
    mmengine_model = pytest.importorskip("mmengine.model")

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.BatchNorm2d(3),
            _OwnBN(3),
            _SubOwnBN(3),
            _MixedBN(3),
            _DirectBN(3),
            ReluNorm2d(3),
            nn.SyncBatchNorm(3),
        )

    plain, converted = build(), distsync.convert_sync_batchnorm(build())
    for model in (plain, converted):
        mmengine_model.initialize(model, dict(type="Constant", layer=[layer], val=2.0, bias=0.5))
    initialized = [i for i, original in enumerate(plain) if original.weight.eq(2.0).all()]
    assert initialized  # each case reaches some of the originals
    for index, (got, original) in enumerate(zip(converted, plain, strict=True)):
        assert isinstance(got, distsync.DistSyncBatchNorm)
        assert torch.equal(got.weight, original.weight) and torch.equal(got.bias, original.bias), (
            layer,
            index,
        )


def _conv_bn_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        ReluNorm2d(4),
        nn.Conv2d(4, 4, 1),
        nn.BatchNorm2d(4),
        nn.Conv2d(4, 2, 1),
        ReluNorm2d(2),
    ).double()
    with torch.no_grad():  # running statistics of their own
        for _ in range(3):
            model(torch.randn(8, 3, 6, 6, dtype=torch.float64) * 2 + 1)
    return model.eval()


def test_conv_bn_fusers_see_a_converted_model_as_the_original_in_eval():
    """mmengine's efficient_conv_bn_eval rewrites each traced conv followed by a batch-norm module node: it
    must not swallow a converted subclass whose forward adds a ReLU (the original is traced through)."""
    pytest.importorskip("mmengine")
    from mmengine.model.efficient_conv_bn_eval import turn_on_efficient_conv_bn_eval_for_single_model
    from torch.fx.experimental.optimization import fuse

    plain = _conv_bn_model()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    expected = plain(x)
    converted = distsync.convert_sync_batchnorm(copy.deepcopy(plain))
    torch.testing.assert_close(fuse(converted)(x), expected)
    turn_on_efficient_conv_bn_eval_for_single_model(converted)
    torch.testing.assert_close(converted(x), expected)
    assert converted(x).min() >= 0  # the last ReLU is there


class _KeepsReluNormWhole(torch.fx.Tracer):
    def is_leaf_module(self, module, name):
        return type(module) is ReluNorm2d or super().is_leaf_module(module, name)


def _nodes(graph_module):
    """The graph's nodes as (op, target), the layer objects that a synchronized call reads left out."""
    nodes = [(n.op, getattr(n.target, "__name__", n.target)) for n in graph_module.graph.nodes]
    layers = {name for name, module in graph_module.named_modules() if isinstance(module, nn.BatchNorm2d)}
    return [(op, target) for op, target in nodes if not (op == "get_attr" and target in layers)]


def test_fx_records_a_converted_subclass_as_it_records_the_original():
    """Traced through where the tracer traces the subclass through (its ReLU kept; a training batch norm
    becomes a synchronized call), one call_module node where the tracer keeps the subclass whole."""
    plain = _conv_bn_model()
    for mode in ("eval", "train"):
        converted = distsync.convert_sync_batchnorm(copy.deepcopy(plain))
        expected = _nodes(torch.fx.symbolic_trace(getattr(plain, mode)()))
        if mode == "train":
            expected = [(op, "synchronized_batch_norm" if t == "batch_norm" else t) for op, t in expected]
        assert _nodes(torch.fx.symbolic_trace(getattr(converted, mode)())) == expected, mode
        assert ("call_function", "relu") in expected
        whole = _nodes(torch.fx.GraphModule(plain, _KeepsReluNormWhole().trace(plain)))
        assert ("call_module", "1") in whole
        assert _nodes(torch.fx.GraphModule(converted, _KeepsReluNormWhole().trace(converted))) == whole
    assert run_world(_traced_training_world, 2) == [True, True]


def _traced_training_world(rank, world_size):
    """A graph traced from a converted model in training mode synchronizes its subclass layers."""
    plain = _conv_bn_model().train()
    graph = torch.fx.symbolic_trace(distsync.convert_sync_batchnorm(copy.deepcopy(plain)))
    x = torch.randn(7, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rows = slice(0, 3) if rank == 0 else slice(3, 7)
    local = x[rows].clone().requires_grad_()
    out = graph(local)
    out.square().sum().backward()
    whole = x.clone().requires_grad_()
    expected = plain(whole)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected[rows])
    torch.testing.assert_close(local.grad, whole.grad[rows])
    for got, want in zip(graph.parameters(), plain.parameters(), strict=True):
        grad = got.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, want.grad)
    torch.testing.assert_close(graph.get_submodule("1").running_var, plain[1].running_var)
    return True


def _unwrapped_world(rank, world_size, wrap):
    import warnings

    model = distsync.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    if wrap:
        model = nn.parallel.DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(2, 3, 2, 2)).sum().backward()
    return [str(w.message) for w in caught if "data-parallel wrapper" in str(w.message)]


def test_a_synchronized_model_without_a_data_parallel_wrapper_is_said_once_on_every_rank():
    for messages in run_world(_unwrapped_world, 2, False):
        assert len(messages) == 1 and "gradients are not averaged" in messages[0]
    assert run_world(_unwrapped_world, 2, True) == [[], []]
