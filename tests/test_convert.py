"""convert_sync_batchnorm / revert_sync_batchnorm keep parameters, buffers and state_dict compatibility."""

import copy
import sys
import warnings

import pytest
import torch
from torch import nn

import distsync
from distsync._syncbn.identity import layer_path
from distsync.batchnorm import DistSyncSyncBatchNorm
from distsync.testing import run_world


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(3, 4, 1),
        nn.BatchNorm1d(4),
        nn.Sequential(nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6, momentum=None)),
        nn.BatchNorm3d(2, affine=False),
        nn.SyncBatchNorm(5, eps=1e-3, track_running_stats=False),
    )


def test_convert_keeps_objects_flags_and_names():
    model = _model()
    model[1].weight.requires_grad_(False)
    model[2][1].eval()
    weight, running_mean = model[1].weight, model[1].running_mean
    converted = distsync.convert_sync_batchnorm(model)
    assert converted is model
    assert type(model[1]) is distsync.DistSyncBatchNorm1d
    assert type(model[2][1]) is distsync.DistSyncBatchNorm2d
    assert type(model[3]) is distsync.DistSyncBatchNorm3d
    assert type(model[4]) is DistSyncSyncBatchNorm
    assert model[1].weight is weight and model[1].running_mean is running_mean
    assert not model[1].weight.requires_grad
    assert not model[2][1].training and model[1].training
    assert model[2][1].momentum is None and model[4].eps == 1e-3 and model[4].running_mean is None
    assert model[3].weight is None
    assert layer_path(model[2][1]) == "2.1"


def test_a_converted_layer_is_an_instance_of_the_class_it_replaced():
    model = distsync.convert_sync_batchnorm(_model())
    for layer, cls in zip([model[1], model[2][1], model[3], model[4]], _PLAIN_CLASSES, strict=True):
        assert isinstance(layer, cls) and isinstance(layer, distsync.DistSyncBatchNorm), (layer, cls)
    # so code that walks a model by type finds them: a freeze-BN loop, a weight-decay exclusion
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()
    assert not model[2][1].training and model[1].training
    built = [cls(4) for cls in (distsync.DistSyncBatchNorm1d, distsync.DistSyncBatchNorm2d)]
    built.append(distsync.DistSyncBatchNorm3d(4))
    for layer, cls in zip(built, _PLAIN_CLASSES, strict=False):
        assert isinstance(layer, cls)
    assert isinstance(distsync.DistSyncBatchNorm(4), distsync.BatchNormNd)
    assert not isinstance(built[1], nn.SyncBatchNorm)  # torch's converter would replace it
    with pytest.raises(ValueError, match="expected 4D input"):
        built[1](torch.randn(2, 4))  # nn.BatchNorm2d's own check and message


_PLAIN_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def test_convert_keeps_dtype_and_process_group_argument():
    layer = nn.BatchNorm2d(3).double()
    converted = distsync.convert_sync_batchnorm(layer, process_group="group-sentinel")
    assert converted.weight.dtype == torch.float64 and converted.running_var.dtype == torch.float64
    assert converted.process_group == "group-sentinel"


def test_layer_paths_are_stamped_by_conversion_and_wrappers_are_left_out():
    model = distsync.convert_sync_batchnorm(_model())
    paths = [layer_path(m) for m in model.modules() if isinstance(m, distsync.DistSyncBatchNorm)]
    assert paths == ["1", "2.1", "3", "4"]
    outer = nn.Sequential()
    outer.add_module("net", model)
    assert layer_path(model[2][1]) == "2.1"  # registering it elsewhere afterwards changes nothing
    distsync.convert_sync_batchnorm(outer)  # converting again from a larger root names from there
    assert layer_path(model[2][1]) == "net.2.1"
    wrapped = nn.DataParallel(distsync.convert_sync_batchnorm(_model()))
    assert layer_path(distsync.convert_sync_batchnorm(wrapped).module[2][1]) == "2.1"


def test_state_dict_loads_both_ways():
    plain = _model()
    synced = distsync.convert_sync_batchnorm(_model())
    assert list(plain.state_dict()) == list(synced.state_dict())
    for param in plain.parameters():
        param.data.uniform_()
    synced.load_state_dict(plain.state_dict())
    plain.load_state_dict(synced.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(value, synced.state_dict()[key])


def test_revert_round_trip_gives_plain_batchnorm_with_same_outputs():
    model = _model()
    reference = [type(m) for m in model.modules()]
    synced = distsync.convert_sync_batchnorm(model)
    reverted = distsync.revert_sync_batchnorm(synced)
    types = [type(m) for m in reverted.modules()]
    assert types[:-1] == reference[:-1]
    assert types[-1] is distsync.BatchNormNd  # from nn.SyncBatchNorm: rank-agnostic local twin
    x = torch.randn(6, 4, 3)
    torch.manual_seed(1)
    bn = nn.BatchNorm1d(4)
    round_trip = distsync.revert_sync_batchnorm(distsync.convert_sync_batchnorm(nn.BatchNorm1d(4)))
    round_trip.load_state_dict(bn.state_dict())
    assert torch.equal(bn(x), round_trip(x))
    assert torch.equal(bn.running_mean, round_trip.running_mean)


def test_conv_bn_fusion_of_a_trained_model_takes_the_reverted_copy():
    """docs/layer.md: torch's fusers (``torch.ao.quantization.fuse_modules``, FX's ``fuse``) find batch norms
    by their exact class, so a trained synchronized model is fused as its reverted copy: the batch norm folds
    into the conv and the fused model computes what the synchronized one does in eval mode.
    ``fuse_conv_bn_eval`` takes a synchronized layer as it is."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    with warnings.catch_warnings():  # their imports use torch.jit.script_method, deprecated in 2.13
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.ao.quantization import fuse_modules
        from torch.fx.experimental.optimization import fuse

    torch.manual_seed(0)
    model = distsync.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()))
    for _ in range(3):  # running statistics and an affine transform of its own, as after training
        model(torch.randn(4, 3, 10, 10) * 3 + 1).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    model.eval()
    x = torch.randn(2, 3, 10, 10)
    expected = model(x)
    reverted = distsync.revert_sync_batchnorm(copy.deepcopy(model)).eval()
    by_ao = fuse_modules(reverted, [["0", "1", "2"]])
    by_fx = fuse(reverted)
    for fused in (by_ao, by_fx):
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules()), fused
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-6)
    folded = fuse_conv_bn_eval(model[0], model[1])
    torch.testing.assert_close(folded(x).relu(), expected, rtol=1e-5, atol=1e-6)
    assert isinstance(model[1], distsync.DistSyncBatchNorm2d)  # the trained model itself is left as it was


def test_optimizer_built_before_conversion_still_trains_the_layer():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    distsync.convert_sync_batchnorm(model)
    before = model[1].weight.detach().clone()
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    assert not torch.equal(before, model[1].weight)


class _CustomNorm(nn.modules.batchnorm._BatchNorm):
    def _check_input_dim(self, input):
        pass


def test_converts_what_pytorch_converts_and_keeps_subclasses():
    model = nn.Sequential(_CustomNorm(3), nn.BatchNorm2d(3), distsync.BatchNormNd(3))
    converted = distsync.convert_sync_batchnorm(model)
    assert [type(m) for m in converted][1:] == [distsync.DistSyncBatchNorm2d, distsync.DistSyncBatchNorm]
    assert isinstance(converted[0], _CustomNorm) and isinstance(converted[0], distsync.DistSyncBatchNorm)
    assert type(distsync.revert_sync_batchnorm(converted)[0]) is _CustomNorm
    with pytest.raises(ValueError, match="uninitialized LazyBatchNorm2d"):
        distsync.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))
    lazy = nn.Sequential(nn.LazyBatchNorm2d())
    lazy(torch.randn(2, 5, 3, 3))  # initialized: it has become an nn.BatchNorm2d
    assert type(distsync.convert_sync_batchnorm(lazy)[0]) is distsync.DistSyncBatchNorm2d


def test_keeps_the_process_group_of_an_nn_syncbatchnorm():
    layer = nn.SyncBatchNorm(3, process_group="group-sentinel")
    assert distsync.convert_sync_batchnorm(layer).process_group == "group-sentinel"
    assert distsync.convert_sync_batchnorm(layer, process_group="other").process_group == "other"


def _conversion_warnings(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = distsync.convert_sync_batchnorm(model)
    return converted, [str(w.message) for w in caught if "convert_sync_batchnorm" in str(w.message)]


def test_a_model_without_batch_norm_is_said_once():
    _, said = _conversion_warnings(nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.LayerNorm(4), nn.ReLU())))
    assert len(said) == 1 and "holds no batch norm" in said[0] and "nothing converted" in said[0]
    converted, said = _conversion_warnings(_model())
    assert said == []
    assert _conversion_warnings(converted)[1] == []  # already synchronized: nothing to say either


def test_quantized_batch_norms_are_left_alone_and_named_in_one_line():
    quantized = pytest.importorskip("torch.ao.nn.quantized")
    from torch.ao.nn.intrinsic.quantized import BNReLU2d

    model = nn.Sequential(quantized.BatchNorm2d(3), nn.Sequential(BNReLU2d(3)), nn.BatchNorm2d(3))
    kept = [model[0], model[1][0]]
    converted, said = _conversion_warnings(model)
    assert converted[0] is kept[0] and converted[1][0] is kept[1]
    assert isinstance(converted[2], distsync.DistSyncBatchNorm2d)
    assert len(said) == 1 and "\n" not in said[0]
    assert "left 0 (torch.ao.nn.quantized" in said[0]
    assert "1.0 (torch.ao.nn.intrinsic.quantized" in said[0] and "quantized batch norm" in said[0]


class _Positive(nn.Module):
    def forward(self, weight):
        return weight.exp()

    def right_inverse(self, weight):
        return weight.log()


def test_a_parametrized_layer_converts_keeping_its_parametrization_and_reverts():
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).double()
    parametrize.register_parametrization(plain[1], "weight", _Positive())
    model = copy.deepcopy(plain)
    original = model[1].parametrizations.weight.original
    converted = distsync.convert_sync_batchnorm(model)
    layer = converted[1]
    assert isinstance(layer, distsync.DistSyncBatchNorm2d) and parametrize.is_parametrized(layer, "weight")
    assert layer.parametrizations.weight.original is original
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64)
    converted(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert torch.equal(original.grad, plain[1].parametrizations.weight.original.grad)
    assert torch.equal(layer.running_var, plain[1].running_var)
    reverted = distsync.revert_sync_batchnorm(converted)[1]
    assert type(reverted).__mro__[1] is nn.BatchNorm2d and parametrize.is_parametrized(reverted, "weight")
    assert reverted.parametrizations.weight.original is original
    assert run_world(_parametrized_world, 2) == [True, True]


def _parametrized_world(rank, world_size):
    """Each rank's slice through the converted parametrized layer: the plain layer on the whole batch."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3).double()
    parametrize.register_parametrization(plain, "weight", _Positive())
    synced = distsync.convert_sync_batchnorm(copy.deepcopy(plain))
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rows = slice(0, 2) if rank == 0 else slice(2, 5)
    out = synced(x[rows])
    (out * x[rows]).sum().backward()
    expected = plain(x)
    (expected * x).sum().backward()
    grad = synced.parametrizations.weight.original.grad.clone()
    torch.distributed.all_reduce(grad)
    torch.testing.assert_close(out, expected[rows])
    torch.testing.assert_close(grad, plain.parametrizations.weight.original.grad)
    torch.testing.assert_close(synced.running_var, plain.running_var)
    return True


def test_jit_script_of_a_synchronized_layer_names_distsync_and_the_way_out():
    model = distsync.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    with pytest.raises(
        RuntimeError, match=r"DistSyncBatchNorm2d at '1'.*revert_sync_batchnorm.*torch.compile"
    ):
        torch.jit.script(model)
    scripted = torch.jit.script(distsync.revert_sync_batchnorm(copy.deepcopy(model)).eval())
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(scripted(x), model.eval()(x))


def test_a_reverted_copy_pickles_without_distsync_and_training_goes_on(tmp_path):
    """docs/recipes.md: ``torch.save(revert_sync_batchnorm(copy.deepcopy(model)))`` for a whole-model
    checkpoint that leaves the project: the pickle names no distsync class and loads in a fresh interpreter
    where distsync cannot be imported (the user's BN subclass comes back); the model stays synchronized."""
    from bn_subclasses import ReluNorm2d
    from launching import run_job

    model = distsync.convert_sync_batchnorm(
        nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), ReluNorm2d(4), nn.BatchNorm1d(2))
    )
    path = tmp_path / "model.pt"
    torch.save(distsync.revert_sync_batchnorm(copy.deepcopy(model)), path)
    assert b"distsync" not in path.read_bytes()
    assert all(isinstance(model[i], distsync.DistSyncBatchNorm) for i in (1, 2, 3))
    script = (
        "import sys; sys.modules['distsync'] = None; import torch; "
        f"print(*(type(m).__name__ for m in torch.load({str(path)!r}, weights_only=False)))"
    )
    proc = run_job([sys.executable, "-c", script], tmp_path, 60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["Conv2d", "BatchNorm2d", "ReluNorm2d", "BatchNorm1d"]
