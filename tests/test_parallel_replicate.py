"""The DataParallel shim, emulated exactly on CPU: torch's own ``replicate`` (with a CPU stand-in for the
CUDA broadcast), the replication callback, then one thread per replica running forward and backward on its
chunk, as the per-device autograd threads do on CUDA. Compared to float64 ``nn.BatchNorm`` on the whole batch.
"""

import copy
import importlib
import io
import pickle
import time
import warnings

import pytest
import torch
from bn_subclasses import ActNorm2d
from torch import nn

import distsync
from distsync import SyncError, check
from distsync.batchnorm import _warn_unwired_replica
from distsync.parallel import (
    DataParallelCriterion,
    DataParallelModel,
    ReplicationCallbackDataParallel,
    SyncMaster,
    convert_model,
    exec_data_parallel_replication_callback,
    patch_replication_callback,
    replica_sync,
    set_sbn_eps_mode,
)
from distsync.testing import run_threads, run_world

_replicate_module = importlib.import_module("torch.nn.parallel.replicate")
_data_parallel_module = importlib.import_module("torch.nn.parallel.data_parallel")
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


@pytest.fixture(autouse=True)
def _plus_eps_mode():
    """These tests compare the transport with nn.BatchNorm's arithmetic, sqrt(var + eps)."""
    set_sbn_eps_mode("plus")
    yield
    set_sbn_eps_mode("clamp")


def _cpu_broadcast(tensors, devices, detach=False):
    """CPU stand-in for the CUDA broadcast inside ``replicate``: copy 0 gets the originals (parameters as
    differentiable aliases, buffers the very same tensors), the other copies get copies whose gradients
    flow back to the originals."""
    copies = []
    for j in range(len(devices)):
        if j == 0:
            copies.append([t if detach else t.view_as(t) for t in tensors])
        else:
            copies.append([t.detach().clone() if detach else t.clone() for t in tensors])
    return copies


@pytest.fixture
def replicate(monkeypatch):
    """``replicate(module, n, callback=True)``: n copies made by torch's replicate, wired by the callback."""
    monkeypatch.setattr(_replicate_module, "_broadcast_coalesced_reshape", _cpu_broadcast)

    def make(module, n, callback=True):
        replicas = _replicate_module.replicate(module, list(range(n)), not torch.is_grad_enabled())
        if callback:
            exec_data_parallel_replication_callback(replicas)
        return replicas

    return make


def _forward_backward(replicas, chunks, grad_chunks):
    """One thread per replica: forward its chunk and backward its part of the output gradient."""

    def step(replica, chunk, grad):
        x = chunk.clone().requires_grad_()
        out = replica(x)
        out.backward(grad)
        return out.detach(), x.grad

    triples = zip(replicas, chunks, grad_chunks, strict=True)
    fns = [lambda r=r, c=c, g=g: step(r, c, g) for r, c, g in triples]
    results, errors = run_threads(fns)
    if errors:
        raise next(iter(errors.values()))
    outs, grads = zip(*(results[i] for i in range(len(replicas))), strict=True)
    return torch.cat(outs), torch.cat(grads)


def _reference(dim, channels, dtype=torch.float64, **bn_kwargs):
    """A float64 two-layer BN model with random affine parameters, and its distsync twin in ``dtype``."""
    torch.manual_seed(0)
    ref = nn.Sequential(_BN[dim](channels, **bn_kwargs), nn.Tanh(), _BN[dim](channels, **bn_kwargs)).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.uniform_(0.5, 1.5)
    model = convert_model(copy.deepcopy(ref)).to(dtype)
    return ref, model


def _sgd(module):
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.1 * p.grad
            p.grad = None


CASES = [
    # dim, feature shape, chunk sizes, dtype, BN options
    pytest.param(1, (4,), (3, 5, 2), torch.float64, {}, id="1d-NC-uneven"),
    pytest.param(1, (3, 5), (4, 4), torch.float64, {"momentum": None}, id="1d-NCL-cumulative"),
    pytest.param(2, (3, 4, 3), (2, 3, 1), torch.float64, {"affine": False}, id="2d-no-affine"),
    pytest.param(3, (2, 3, 2, 2), (1, 2, 2, 1), torch.float64, {"momentum": 0.3}, id="3d-four-replicas"),
    pytest.param(2, (5, 3, 3), (4, 1, 3), torch.float32, {}, id="2d-float32"),
    pytest.param(2, (3, 2, 2), (3, 2), torch.float64, {"track_running_stats": False}, id="2d-no-running"),
]


@pytest.mark.parametrize("dim, shape, sizes, dtype, options", CASES)
def test_replicas_equal_batchnorm_on_the_whole_batch(replicate, dim, shape, sizes, dtype, options):
    ref, model = _reference(dim, shape[0], dtype, **options)
    tol = {"rtol": 1e-9, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    for step in range(3):
        torch.manual_seed(100 + step)
        x = torch.randn(sum(sizes), *shape, dtype=torch.float64) * (step + 1) + step
        grad = torch.randn_like(x)
        xr = x.clone().requires_grad_()
        expected = ref(xr)
        expected.backward(grad)

        replicas = replicate(model, len(sizes))
        assert all(b is c for b, c in zip(replicas[0].buffers(), model.buffers(), strict=True))
        before = [b.clone() for b in model.buffers()]
        out, x_grad = _forward_backward(replicas, x.to(dtype).split(sizes), grad.to(dtype).split(sizes))
        for b, c in zip(replicas[-1].buffers(), before, strict=True):  # only copy 0 updates running stats
            torch.testing.assert_close(b, c, rtol=0, atol=0)

        torch.testing.assert_close(out.double(), expected.detach(), **tol)
        torch.testing.assert_close(x_grad.double(), xr.grad, **tol)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad.double(), q.grad, **tol, msg=f"grad of {name}, step {step}")
        for (name, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
            torch.testing.assert_close(b.to(c.dtype), c, **tol, msg=f"{name}, step {step}")  # updated once
        _sgd(model)
        _sgd(ref)

    model.eval()
    ref.eval()
    x = torch.randn(5, *shape, dtype=torch.float64)
    torch.testing.assert_close(model(x.to(dtype)).double(), ref(x), **tol)


def test_replicas_of_a_converted_subclass_keep_its_forward(replicate):
    """A converted BatchNormAct-style subclass under the shim: its activation and extra parameter applied on
    every replica, its statistics those of the whole batch."""
    torch.manual_seed(0)
    ref = nn.Sequential(ActNorm2d(3), nn.Conv2d(3, 3, 1), ActNorm2d(3, momentum=None)).double()
    model = convert_model(copy.deepcopy(ref)).float()
    assert isinstance(model[0], ActNorm2d) and isinstance(model[0], distsync.DistSyncBatchNorm)
    for step in range(2):
        torch.manual_seed(10 + step)
        x = torch.randn(7, 3, 4, 4, dtype=torch.float64) * 2 + 1
        grad = torch.randn(7, 3, 4, 4, dtype=torch.float64)
        xr = x.clone().requires_grad_()
        expected = ref(xr)
        expected.backward(grad)
        chunks, grad_chunks = x.float().split([3, 1, 3]), grad.float().split([3, 1, 3])
        out, x_grad = _forward_backward(replicate(model, 3), chunks, grad_chunks)
        torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x_grad.double(), xr.grad, rtol=1e-4, atol=1e-4)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-4, msg=name)
        for name in ("0.running_mean", "0.running_var", "2.running_var", "2.num_batches_tracked"):
            got, want = model.state_dict()[name], ref.state_dict()[name]
            torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-4, atol=1e-4, msg=name)
        _sgd(model)
        _sgd(ref)


def test_a_layer_called_twice_per_forward_syncs_each_call(replicate):
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(3).double()
    model = convert_model(copy.deepcopy(ref))
    twice = nn.Sequential(model, nn.Tanh(), model)
    x, grad = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    expected = ref(torch.tanh(ref(xr)))
    expected.backward(grad)
    out, x_grad = _forward_backward(replicate(twice, 2), x.split([4, 3]), grad.split([4, 3]))
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(x_grad, xr.grad)
    torch.testing.assert_close(model.running_var, ref.running_var)
    assert int(model.num_batches_tracked) == 2


def test_original_module_stays_unwired_and_picklable(replicate):
    _, model = _reference(2, 3)
    replicas = replicate(model, 2)
    layers = [m for m in replicas[1].modules() if isinstance(m, distsync.DistSyncBatchNorm)]
    assert all(layer._replica_reducer.world_size == 2 for layer in layers)
    assert all(
        m._replica_reducer is None for m in model.modules() if isinstance(m, distsync.DistSyncBatchNorm)
    )
    buffer = io.BytesIO()
    torch.save(ReplicationCallbackDataParallel(model), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded.module[0].running_mean, model[0].running_mean)


class _FailOnChunk(nn.Module):
    """Raises in the replica whose chunk has ``size`` samples, before any synchronized layer."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def forward(self, x):
        if x.shape[0] == self.size:
            raise RuntimeError("replica exploded")
        return x


def test_a_replica_failing_in_forward_makes_the_others_raise_within_the_timeout(replicate, monkeypatch):
    monkeypatch.setattr(replica_sync, "REPLICA_SYNC_TIMEOUT", 0.5)
    model = nn.Sequential(_FailOnChunk(2), distsync.DistSyncBatchNorm1d(3))
    replicas = replicate(model, 3)
    chunks = torch.randn(9, 3).split([3, 2, 4])
    start = time.monotonic()
    _, errors = run_threads([lambda r=r, c=c: r(c) for r, c in zip(replicas, chunks, strict=True)])
    assert time.monotonic() - start < 5.0
    assert isinstance(errors[1], RuntimeError) and "exploded" in str(errors[1])
    assert isinstance(errors[0], SyncError) and isinstance(errors[2], SyncError)


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward exploded")


class _FailBackwardOnChunk(nn.Module):
    def forward(self, x):
        return _FailInBackward.apply(x) if x.shape[0] == 2 else x


def test_a_replica_failing_in_backward_makes_the_others_raise_within_the_timeout(replicate, monkeypatch):
    monkeypatch.setattr(replica_sync, "REPLICA_SYNC_TIMEOUT", 0.5)
    model = nn.Sequential(
        distsync.DistSyncBatchNorm1d(3), _FailBackwardOnChunk(), distsync.DistSyncBatchNorm1d(3)
    )
    replicas = replicate(model, 2)
    x, grad = torch.randn(5, 3), torch.randn(5, 3)
    start = time.monotonic()
    with pytest.raises((SyncError, RuntimeError)):
        _forward_backward(replicas, x.split([3, 2]), grad.split([3, 2]))
    assert time.monotonic() - start < 5.0


def test_a_backward_on_one_thread_raises_at_once_instead_of_waiting(replicate, monkeypatch):
    """``torch.autograd.set_multithreading_enabled(False)`` runs the copies' backward passes one after another
    on the calling thread, where the first would wait for the others: it raises at once, saying why."""
    monkeypatch.setattr(replica_sync, "REPLICA_SYNC_TIMEOUT", 10.0)
    model = nn.Sequential(distsync.DistSyncBatchNorm1d(3), nn.Tanh())
    replicas = replicate(model, 2)
    x = torch.randn(6, 3, requires_grad=True)
    results, errors = run_threads([lambda r=r, c=c: r(c) for r, c in zip(replicas, x.split(3), strict=True)])
    assert not errors
    gathered = torch.cat([results[0], results[1]])
    start = time.monotonic()
    with pytest.raises(SyncError, match=r"set_multithreading_enabled\(False\)") as raised:
        with torch.autograd.set_multithreading_enabled(False):
            gathered.sum().backward()
    assert time.monotonic() - start < 5.0
    assert "DistributedDataParallel" in str(raised.value)


def test_data_parallel_methods_wire_replicas_and_release_siblings(replicate, monkeypatch):
    """``replicate`` runs the callback and ``parallel_apply`` aborts the siblings of a failing replica at
    once (no timeout needed), for the subclass and for a patched plain ``nn.DataParallel``."""
    monkeypatch.setattr(replica_sync, "REPLICA_SYNC_TIMEOUT", 60.0)

    def cpu_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):  # threads, as on CUDA
        results, errors = run_threads([lambda m=m, x=x: m(*x) for m, x in zip(modules, inputs, strict=True)])
        if errors:
            raise next(iter(errors.values()))
        return [results[i] for i in range(len(modules))]

    monkeypatch.setattr(_data_parallel_module, "parallel_apply", cpu_parallel_apply)
    model = nn.Sequential(_FailOnChunk(2), distsync.DistSyncBatchNorm1d(3))
    plain = nn.DataParallel(model)
    patch_replication_callback(plain)
    for dp in (ReplicationCallbackDataParallel(model), plain):
        x = torch.randn(9, 3)
        replicas = dp.replicate(model, [0, 1, 2])
        assert all(r[1]._replica_reducer is not None for r in replicas)
        out = dp.parallel_apply(replicas, [(c,) for c in x.split([3, 3, 3])], [{}] * 3)
        torch.testing.assert_close(torch.cat(out), nn.functional.batch_norm(x, None, None, training=True))
        replicas = dp.replicate(model, [0, 1, 2])
        start = time.monotonic()
        with pytest.raises((RuntimeError, SyncError)):
            dp.parallel_apply(replicas, [(c,) for c in x.split([3, 2, 4])], [{}] * 3)
        assert time.monotonic() - start < 5.0


def test_replicated_without_callback_warns_once(replicate):
    _warn_unwired_replica.cache_clear()
    model = distsync.DistSyncBatchNorm1d(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            replicas = replicate(model, 2, callback=False)
            for replica, chunk in zip(replicas, torch.randn(8, 3).split(4), strict=True):
                out = replica(chunk)  # per-replica statistics: it cannot sync
                torch.testing.assert_close(out, nn.functional.batch_norm(chunk, None, None, training=True))
    unwired = [w for w in caught if "replication callback" in str(w.message)]
    assert len(unwired) == 1 and issubclass(unwired[0].category, RuntimeWarning)


def test_the_cpu_check_of_the_shim_passes_and_sees_a_broken_transport(monkeypatch, capsys):
    """``python -m distsync.check --shim``: DataParallel's copies emulated on the CPU, as the documented way
    to check the shim without GPUs; it reports the shim's errors, so it fails when the transport is wrong."""
    assert check.main(["--shim", "--nproc", "3"]) == 0
    assert "12 passed, 0 failed" in capsys.readouterr().out
    case = check.Case((2, 3), shape=(4, 3), dtype=torch.float64)
    errors = check.run_shim_case(case)
    assert max(errors.values()) < check.tolerance(case)
    assert set(errors) >= {"output", "input grad", "weight grad", "running_var", "eval output"}

    monkeypatch.setattr(replica_sync, "replica_reducer", lambda *args: None)  # copies left unwired
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that they cannot sync
        assert max(check.run_shim_case(case).values()) > 1e-2


class _LegacySum(nn.Module):
    """A custom module written against Synchronized-BatchNorm's SyncMaster: sums a value over replicas."""

    def __init__(self):
        super().__init__()
        self._sync_master = SyncMaster(self._master_callback)
        self._slave_pipe = None
        self.order = []

    def __data_parallel_replicate__(self, ctx, copy_id):
        self.order.append(copy_id)
        if copy_id == 0:
            ctx.sync_master = self._sync_master
        else:
            self._slave_pipe = ctx.sync_master.register_slave(copy_id)

    def _master_callback(self, intermediates):
        assert intermediates[0][0] == 0
        total = sum(msg for _, msg in intermediates)
        return [(i, total) for i, _ in intermediates]

    def forward(self, x):
        msg = float(x.sum())
        total = (
            self._sync_master.run_master(msg) if self._slave_pipe is None else self._slave_pipe.run_slave(msg)
        )
        return x * 0 + total


def test_custom_modules_built_on_sync_master_keep_working(replicate):
    module = _LegacySum()
    x = torch.randn(6, 2)
    for _ in range(2):  # the same SyncMaster serves a new replication each forward
        replicas = replicate(module, 3)
        pairs = zip(replicas, x.split(2), strict=True)
        results, errors = run_threads([lambda r=r, c=c: r(c) for r, c in pairs])
        assert not errors
        assert all(torch.allclose(results[i], torch.full((2, 2), float(x.sum()))) for i in range(3))
    assert module.order == [0, 1, 2, 0, 1, 2]  # the master copy first
    assert pickle.loads(pickle.dumps(module))._sync_master.nr_slaves == 0


def test_data_parallel_model_and_criterion_degrade_to_plain_calls_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), distsync.parallel.SynchronizedBatchNorm1d(3))
    net, criterion = DataParallelModel(model), DataParallelCriterion(nn.CrossEntropyLoss())
    x, target = torch.randn(6, 4), torch.randint(0, 3, (6,))
    out = net(x)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(criterion(out, target), nn.functional.cross_entropy(model(x), target))


def test_old_style_code_runs_with_changed_imports_only():
    # Synchronized-BatchNorm-PyTorch's README, with `sync_batchnorm` replaced by `distsync.parallel`.
    from distsync.parallel import (
        DataParallelWithCallback,
        SynchronizedBatchNorm1d,
        patch_replication_callback,
    )

    sync_bn = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False)
    sync_bn = DataParallelWithCallback(sync_bn, device_ids=[0, 1])
    assert sync_bn(torch.randn(16, 10)).shape == (16, 10)
    sync_bn = nn.DataParallel(SynchronizedBatchNorm1d(10, eps=1e-5, affine=False), device_ids=[0, 1])
    patch_replication_callback(sync_bn)
    assert sync_bn(torch.randn(16, 10)).shape == (16, 10)

    from distsync.parallel import convert_model

    model = convert_model(nn.DataParallel(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))))
    assert isinstance(model, DataParallelWithCallback)
    assert isinstance(model.module[1], distsync.DistSyncBatchNorm2d)

    # jactorch and PyTorch-Encoding names, from the submodules too.
    from distsync.parallel.comm import SlavePipe, SyncMaster  # noqa: F401
    from distsync.parallel.replicate import (  # noqa: F401
        CallbackContext,
        ReplicationCallbackDataParallel,
        exec_data_parallel_replication_callback,
    )

    assert distsync.DataParallelModel is DataParallelModel
    assert issubclass(distsync.SynchronizedBatchNorm3d, distsync.DistSyncBatchNorm3d)
    assert type(model.module[1]) is distsync.SynchronizedBatchNorm2d  # with Synchronized-BatchNorm's eps


def _hierarchical_worker(rank, world_size, sizes):
    """One process of a hierarchical run: two DataParallel-style replica threads, then the gloo group."""
    _replicate_module._broadcast_coalesced_reshape = _cpu_broadcast  # a fresh spawned process
    set_sbn_eps_mode("plus")  # compared with nn.BatchNorm's arithmetic, as in the fixture above
    ref, model = _reference(2, 3)
    x = torch.randn(
        sum(map(sum, sizes)), 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    grad = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mine = x.split([sum(s) for s in sizes])[rank].split(sizes[rank])
    mine_grad = grad.split([sum(s) for s in sizes])[rank].split(sizes[rank])
    replicas = _replicate_module.replicate(model, [0, 1], False)
    exec_data_parallel_replication_callback(replicas)
    assert replicas[1][0]._replica_reducer.world_size == 4
    out, x_grad = _forward_backward(replicas, mine, mine_grad)
    grads = [p.grad for p in model.parameters()]
    buffer = io.BytesIO()  # bytes, not tensors: shared-memory tensors die with the worker process
    torch.save((out, x_grad, grads, list(model.buffers())), buffer)
    return buffer.getvalue()


def test_hierarchical_two_processes_times_two_replicas():
    sizes = [(3, 2), (1, 4)]
    outcomes = run_world(_hierarchical_worker, 2, sizes, timeout=120)
    results = [torch.load(io.BytesIO(data)) for data in outcomes]
    ref, _ = _reference(2, 3)
    x = torch.randn(10, 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xr = x.clone().requires_grad_()
    expected = ref(xr)
    expected.backward(grad)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), expected.detach())
    torch.testing.assert_close(torch.cat([r[1] for r in results]), xr.grad)
    for i, q in enumerate(ref.parameters()):  # DDP would average; the sum over ranks is the global gradient
        torch.testing.assert_close(results[0][2][i] + results[1][2][i], q.grad)
    for rank in range(2):  # every rank's running stats are those of the global batch, updated once
        for b, c in zip(results[rank][3], ref.buffers(), strict=True):
            torch.testing.assert_close(b, c)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_data_parallel_on_cuda():
    devices = list(range(torch.cuda.device_count()))
    ref, model = _reference(2, 4)
    ref, model = ref.cuda(), model.cuda()
    net = ReplicationCallbackDataParallel(model, device_ids=devices)
    for step in range(2):
        x = torch.randn(4 * len(devices) + 1, 4, 3, 3, dtype=torch.float64, device="cuda") + step
        grad = torch.randn_like(x)
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = ref(xr)
        expected.backward(grad)
        out = net(xs)
        out.backward(grad)
        torch.testing.assert_close(out, expected.detach())
        torch.testing.assert_close(xs.grad, xr.grad)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
        for b, c in zip(model.buffers(), ref.buffers(), strict=True):
            torch.testing.assert_close(b, c)
        _sgd(model)
        _sgd(ref)
