"""Real-training-code behaviours: identity that survives other modules, torch-compatible semantics, faults.

Each world runs every scenario in one spawn (spawning dominates the cost) and returns what each rank saw.
"""

import contextlib
import copy
import functools
import inspect
import io
from datetime import timedelta

import pytest
import torch
from cuda_emulation import cuda_path_on_cpu
from torch import nn

import distsync
from distsync.testing import run_world


def _outcome(fn):
    try:
        result = fn()
    except Exception as error:  # the test compares what each rank raised
        return type(error).__name__, str(error)
    return None, result


def _model():
    torch.manual_seed(0)
    return distsync.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4)))


def _x(n=3):
    return torch.randn(n, 4, 2, 2)


class _TwoLayers(nn.Module):
    """Two same-width layers whose order a forward argument can swap."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x, swap=False):
        return self.a(self.b(x)) if swap else self.b(self.a(x))


def _two_layers():
    return distsync.convert_sync_batchnorm(_TwoLayers())


def _identity_scenarios(rank, world_size, saved_model):
    seen = {}
    # Rank 0 builds extra synced layers first (an EMA copy, a probe): ids must not shift.
    if rank == 0:
        distsync.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm2d(7)))
        distsync.DistSyncBatchNorm2d(4)
    model = _model()
    seen["extra layers on one rank"] = _outcome(lambda: model(_x()).shape)
    # A deep copy (teacher) called on one rank against the original (student) on the other.
    teacher = copy.deepcopy(model)
    seen["deepcopy vs original"] = _outcome(lambda: (model if rank == 0 else teacher)[0](_x()).shape)
    # Two same-width layers in swapped order.
    fresh = _model()
    order = (0, 2) if rank == 0 else (2, 0)
    seen["swapped layers"] = _outcome(lambda: [fresh[i](_x()) for i in order] and None)
    # Layers constructed directly inside a module (never converted) get their paths from it at their
    # first call.
    direct = _TwoLayers()
    direct.a, direct.b = distsync.DistSyncBatchNorm2d(4), distsync.DistSyncBatchNorm2d(4)
    seen["direct layers swapped"] = _outcome(lambda: direct(_x(), swap=rank == 1).shape)
    # A model loaded whole (torch.load) on rank 0 and built on rank 1 is the same model...
    loaded = torch.load(io.BytesIO(saved_model), weights_only=False) if rank == 0 else _two_layers()
    seen["loaded vs built"] = _outcome(lambda: loaded(_x()).shape)
    # ...and so is a deep copy made by every rank (an EMA teacher), whose layers keep their paths...
    teacher = copy.deepcopy(_two_layers())
    seen["teacher"] = _outcome(lambda: teacher(_x()).shape)
    seen["teacher swapped"] = _outcome(lambda: teacher(_x(), swap=rank == 1).shape)
    # ...but a student's first call never passes for its teacher's.
    student = _two_layers()
    teacher = copy.deepcopy(student)
    seen["student vs teacher"] = _outcome(lambda: (student if rank == 0 else teacher)(_x()).shape)
    return seen


def test_layer_identity_does_not_depend_on_what_else_a_process_built():
    buffer = io.BytesIO()
    torch.save(_two_layers(), buffer)
    for seen in run_world(_identity_scenarios, 2, buffer.getvalue()):
        for scenario in ("extra layers on one rank", "loaded vs built", "teacher"):
            assert seen[scenario] == (None, torch.Size([3, 4, 2, 2])), (scenario, seen[scenario])
        mismatches = ("deepcopy vs original", "swapped layers", "direct layers swapped", "teacher swapped")
        for scenario in (*mismatches, "student vs teacher"):
            assert seen[scenario][0] == "SyncMismatchError", (scenario, seen[scenario])


def _semantics_scenarios(rank, world_size):
    seen = {}
    layer = distsync.DistSyncBatchNorm2d(4)
    # A rejected input on one rank still takes part in the all-reduce: every rank raises at that call...
    x = _x().long() if rank == 1 else _x()
    seen["rejected input"] = _outcome(lambda: layer(x))
    # ...and stays in step afterwards.
    seen["next call"] = _outcome(lambda: layer(_x()).shape)
    # Eval without running statistics never syncs (nn.SyncBatchNorm): rank 0 evaluates alone.
    no_stats = distsync.DistSyncBatchNorm2d(4, track_running_stats=False).eval()
    if rank == 0:
        seen["eval alone"] = _outcome(
            lambda: torch.equal(no_stats(x), nn.functional.batch_norm(x, None, None, training=True))
        )
    # DDP inference (PyTorch's test_ddp_inference): a converted, DDP-wrapped model in eval mode gives the
    # plain model's eval output on every rank.
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).eval()
    ddp = nn.parallel.DistributedDataParallel(distsync.convert_sync_batchnorm(copy.deepcopy(plain))).eval()
    with torch.no_grad():
        seen["ddp inference"] = _outcome(lambda: torch.equal(ddp(x.float()), plain(x.float())))
    # An empty global batch gives an empty output, like nn.BatchNorm, and leaves running stats alone.
    before = layer.running_mean.clone()
    seen["empty global batch"] = _outcome(
        lambda: (layer(torch.randn(0, 4, 2, 2)).shape, torch.equal(before, layer.running_mean))
    )

    # Only empty inputs, with backward (PyTorch's test_sync_batch_norm_only_empty_input).
    def only_empty():
        empty_layer = distsync.DistSyncBatchNorm2d(4)
        inp = torch.randn(0, 4, 2, 2, requires_grad=True)
        empty_layer(inp).sum().backward()
        layer_grad = empty_layer.weight.grad.abs().sum().item()
        return inp.grad.shape, layer_grad, empty_layer.num_batches_tracked.item()

    seen["only empty inputs"] = _outcome(only_empty)

    # Double backward: one clear error on every rank.
    def double_backward():
        inp = _x().requires_grad_()
        (grad,) = torch.autograd.grad(layer(inp).pow(2).sum(), inp, create_graph=True)
        grad.sum().backward()

    seen["double backward"] = _outcome(double_backward)
    # eps <= 0 is refused in training as F.batch_norm refuses it.
    seen["eps=0"] = _outcome(lambda: distsync.DistSyncBatchNorm2d(4, eps=0.0)(_x()))
    seen["eps=-1"] = _outcome(lambda: distsync.DistSyncBatchNorm2d(4, eps=-1.0)(_x()))
    # check_sync has nothing deferred on the CPU.
    seen["check_sync"] = _outcome(distsync.check_sync)
    # torch.func.functional_call (ensembles, meta-learning): the call syncs with the tensors passed in and
    # moves the running statistics passed in, not the layer's own.
    model = _functional_model(distsync.convert_sync_batchnorm)
    tensors = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    out = torch.func.functional_call(model, tensors, (_FUNCTIONAL_BATCH[_FUNCTIONAL_ROWS[rank]],))
    seen["functional_call"] = out, tensors, model.state_dict()
    return seen


_FUNCTIONAL_BATCH = (
    torch.randn(5, 4, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 3 + 2
)
_FUNCTIONAL_ROWS = (slice(0, 2), slice(2, 5))  # each rank's share


def _functional_model(convert=lambda model: model):
    torch.manual_seed(2)
    return convert(nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).double())


def test_torch_compatible_semantics_on_every_rank():
    per_rank = run_world(_semantics_scenarios, 2)
    assert (
        per_rank[1]["rejected input"][0] == "ValueError"
        and "floating-point" in per_rank[1]["rejected input"][1]
    )
    assert per_rank[0]["rejected input"][0] == "SyncError"
    for seen in per_rank:
        assert seen["next call"] == (None, torch.Size([3, 4, 2, 2])), seen["next call"]
        assert seen["ddp inference"] == (None, True), seen["ddp inference"]
        assert seen["empty global batch"] == (None, (torch.Size([0, 4, 2, 2]), True))
        assert seen["double backward"][0] == "RuntimeError" and "twice" in seen["double backward"][1]
        for key in ("eps=0", "eps=-1"):
            assert seen[key][0] == "ValueError" and "eps must be positive" in seen[key][1]
        assert seen["check_sync"] == (None, None)
        assert seen["only empty inputs"] == (None, (torch.Size([0, 4, 2, 2]), 0.0, 1))
    assert per_rank[0]["eval alone"] == (None, True)
    model = _functional_model()
    untouched = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    tensors = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    expected = torch.func.functional_call(model, tensors, (_FUNCTIONAL_BATCH,))
    for rows, seen in zip(_FUNCTIONAL_ROWS, per_rank, strict=True):
        out, moved, own = seen["functional_call"]
        torch.testing.assert_close(out, expected[rows], rtol=1e-12, atol=1e-12)
        for name, tensor in tensors.items():
            torch.testing.assert_close(moved[name], tensor, rtol=1e-12, atol=1e-12, msg=name)
            assert torch.equal(own[name], untouched[name]), name


_RECALIBRATION_BATCH = torch.randn(7, 4, 3, 3, generator=torch.Generator().manual_seed(5)) * 2 + 3
_RECALIBRATION_DY = torch.randn(7, 4, 3, 3, generator=torch.Generator().manual_seed(6))
_RECALIBRATION_ROWS = (slice(0, 3), slice(3, 7))  # each rank's share, uneven
_RECALIBRATION_PATHS = ((False, torch.float64), (False, torch.float32), (True, torch.float32))  # CUDA's?


def _recalibration_model(dtype, convert=lambda model: model):
    torch.manual_seed(4)
    return convert(nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))).to(dtype)


def _recalibrate_then_train(model, x, dy):
    """A train-mode pass under ``torch.inference_mode()`` (what recalibrating the running statistics after
    a change of weights or data looks like), the layer's first call, then two training steps: the input's
    gradients and the batch norm's buffers."""
    with torch.inference_mode():
        model(x)
    grads = []
    for _ in range(2):
        inp = x.clone().requires_grad_()
        (model(inp) * dy).sum().backward()
        grads.append(inp.grad)
    return grads, model[1].state_dict()


def _recalibrated_under_inference_mode(rank, world_size):
    seen = {}
    rows = _RECALIBRATION_ROWS[rank]
    for cuda_path, dtype in _RECALIBRATION_PATHS:
        with cuda_path_on_cpu() if cuda_path else contextlib.nullcontext():
            model = _recalibration_model(dtype, distsync.convert_sync_batchnorm)
            batch = (_RECALIBRATION_BATCH[rows].to(dtype), _RECALIBRATION_DY[rows].to(dtype))
            seen[cuda_path, dtype] = _outcome(functools.partial(_recalibrate_then_train, model, *batch))
            distsync.check_sync()
    return seen


def test_a_train_mode_pass_under_inference_mode_leaves_the_layer_trainable():
    """The tensors a layer keeps from its first call (per-channel zeros saved for backward, the buffer a
    device's running-statistics update writes into) are made outside inference mode: the training steps
    that follow give what ``nn.BatchNorm2d`` gives on the full batch, on the CPU's path (float64, around a
    shift, and float32) and CUDA's (emulated), rather than "Inference tensors cannot be saved for
    backward" or an in-place update refused."""
    per_rank = run_world(_recalibrated_under_inference_mode, 2)
    for cuda_path, dtype in _RECALIBRATION_PATHS:
        reference = _recalibration_model(dtype)
        x, dy = _RECALIBRATION_BATCH.to(dtype), _RECALIBRATION_DY.to(dtype)
        grads, buffers = _recalibrate_then_train(reference, x, dy)
        tolerance = 1e-10 if dtype == torch.float64 else 2e-5
        for rows, seen in zip(_RECALIBRATION_ROWS, per_rank, strict=True):
            error, result = seen[cuda_path, dtype]
            assert error is None, (cuda_path, dtype, result)
            for expected, actual in zip(grads, result[0], strict=True):
                torch.testing.assert_close(actual, expected[rows], rtol=tolerance, atol=tolerance)
            for name, buffer in buffers.items():
                torch.testing.assert_close(result[1][name], buffer, rtol=tolerance, atol=tolerance, msg=name)


def _float64_far_from_zero(rank, world_size, ratio):
    layer = distsync.DistSyncBatchNorm1d(3, dtype=torch.float64)
    sizes = [5 + r for r in range(world_size)]
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    errors = []
    for step in range(3):
        full = torch.randn(
            sum(sizes), 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step)
        )
        full = full + ratio
        expected = nn.functional.batch_norm(full, None, None, training=True)[rows]
        out = layer(full[rows])
        errors.append(((out - expected).norm() / expected.norm()).item())
    return errors


@pytest.mark.parametrize("ratio", [1e6, 1e8])
def test_float64_keeps_float64_accuracy_far_from_zero(ratio):
    """The first call is merged again around its mean (CPU), the next ones around the previous global mean."""
    for errors in run_world(_float64_far_from_zero, 2, ratio):
        assert max(errors) < 1e-7, errors


def _peer_gone(rank, world_size):
    """Rank 1 leaves without calling the layer: rank 0's all-reduce fails and must name the layer."""
    group = torch.distributed.new_group([0, 1], timeout=timedelta(seconds=3))
    if rank == 1:
        return None
    model = distsync.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), process_group=group)
    try:
        model(_x())
    except distsync.SyncError as error:
        return str(error), isinstance(error.__cause__, RuntimeError)  # gloo's own error kept as the cause
    return "no error"


def test_a_dead_peer_is_reported_naming_the_layer():
    message, cause_kept = run_world(_peer_gone, 2)[0]
    expected = "the all-reduce of '0' (DistSyncBatchNorm2d), forward call #0 failed: "
    assert message.startswith(expected), message
    assert cause_kept


def test_collective_failure_names_the_layer():
    class Broken:
        world_size, first = 2, True

        def all_reduce(self, payload):
            raise RuntimeError("Connection reset by peer")

        def announce(self, call):
            pass

    layer = distsync.DistSyncBatchNorm2d(4)
    layer._replica_reducer = Broken()
    with pytest.raises(distsync.SyncError, match="forward call #0 failed: Connection reset by peer") as info:
        layer(_x())
    assert isinstance(info.value.__cause__, RuntimeError)


def test_bias_false_and_pytorch_encoding_signature():
    assert run_world(_encoding_signature, 2) == [True, True]
    if "bias" not in inspect.signature(nn.BatchNorm2d.__init__).parameters:  # torch < 2.12
        with pytest.raises(TypeError, match="bias=False needs torch >= 2.12"):
            distsync.DistSyncBatchNorm2d(4, bias=False)
        assert distsync.DistSyncBatchNorm2d(4, bias=True).bias is not None
        return
    layer = distsync.DistSyncBatchNorm2d(4, bias=False)
    assert layer.bias is None and layer.weight is not None
    plain = nn.BatchNorm2d(4, bias=False)
    assert distsync.revert_sync_batchnorm(distsync.convert_sync_batchnorm(copy.deepcopy(plain))).bias is None
    plain.load_state_dict(distsync.convert_sync_batchnorm(nn.BatchNorm2d(4, bias=False)).state_dict())


def _encoding_signature(rank, world_size):
    group = torch.distributed.new_group([0, 1])
    layer = distsync.DistSyncBatchNorm(4, 1e-5, 0.1, group)  # PyTorch-Encoding's positional order
    return layer.process_group is group and layer.affine


def _clip_mode(rank, world_size):
    """eps_mode='clamp' (Synchronized-BatchNorm's default): std = sqrt(max(var, eps)) when synchronized."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(8, 3, 5, dtype=torch.float64, generator=gen)
    full[:, 0] *= 1e-4  # variance 1e-8, far below eps: clipped
    full = full.requires_grad_()
    dy = torch.randn(full.shape, dtype=torch.float64, generator=gen)
    eps = 1e-5
    mean = full.mean((0, 2), keepdim=True)
    var = full.var((0, 2), unbiased=False, keepdim=True)
    expected = (full - mean) / var.clamp(min=eps).sqrt()
    expected.backward(dy)
    rows = slice(4 * rank, 4 * rank + 4)
    layer = distsync.DistSyncBatchNorm1d(3, eps=eps, affine=False, dtype=torch.float64)
    layer.eps_mode = "clamp"
    x = full.detach()[rows].clone().requires_grad_()
    out = layer(x)
    out.backward(dy[rows])
    error = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return error(out, expected[rows]), error(x.grad, full.grad[rows])


def test_clip_eps_mode_matches_its_definition():
    for output_error, grad_error in run_world(_clip_mode, 2):
        assert output_error < 1e-10 and grad_error < 1e-10, (output_error, grad_error)


def _infinite_input(rank, world_size):
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        x[0, 0, 0], x[1, 1, 1] = float("inf"), float("-inf")
    gathered = [torch.zeros_like(x) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, x)
    reference = nn.BatchNorm1d(2)
    reference(torch.cat(gathered))
    layer = distsync.DistSyncBatchNorm1d(2)
    layer(x)
    return [(r, s) for r, s in zip(reference.state_dict().values(), layer.state_dict().values(), strict=True)]


def test_infinite_inputs_give_the_running_stats_nn_batchnorm_gives():
    for pairs in run_world(_infinite_input, 2):
        for expected, actual in pairs:
            assert torch.equal(expected.isnan(), actual.isnan())
            assert torch.equal(expected.nan_to_num(), actual.nan_to_num())


def _half_buffers_cumulative_average(rank, world_size):
    """momentum=None on a model.half() layer: the 1 / num_batches_tracked weight must not underflow."""
    layer = distsync.DistSyncBatchNorm1d(2, momentum=None).half()
    layer.num_batches_tracked.fill_(10**8)  # 1e-8 underflows to 0 in float16 (smallest subnormal 6e-8)
    x = (torch.randn(4, 2, generator=torch.Generator().manual_seed(rank)) + 1000).half()
    layer(x)
    return layer.running_mean.float().tolist()


def test_half_buffers_keep_the_cumulative_average_moving():
    for running_mean in run_world(_half_buffers_cumulative_average, 2):
        assert all(0 < value < 1e-3 for value in running_mean), running_mean  # about 1000 / 1e8
