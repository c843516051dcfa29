"""The CUDA code path run in CI: its kernel class, tails and deferred verdicts on CPU tensors.

CPU implementations of the four CUDA batch-norm ops (``cuda_emulation.py``, written to PyTorch's CUDA
kernels and their checks) stand in for the GPU; 2-rank gloo worlds stand in for NCCL.
"""

import pytest
import torch
from cuda_emulation import EmulatedCudaKernels, cuda_path_on_cpu

import distsync
from distsync._syncbn import health as _health
from distsync._syncbn import kernels as _kernels
from distsync.check import Case, default_cases, run_case, tolerance
from distsync.errors import SyncError, SyncMismatchError
from distsync.testing import run_world


def _parity(rank, world_size, cases):
    with cuda_path_on_cpu():
        assert _kernels.kernels_for(torch.device("cpu")) is EmulatedCudaKernels
        return [run_case(case, rank) for case in cases]


def test_cuda_path_matches_batchnorm_on_the_global_batch():
    cases = default_cases(2)
    for errors in run_world(_parity, 2, cases):
        for case, found in zip(cases, errors, strict=True):
            assert max(found.values()) <= tolerance(case, 2, "cuda"), (case.describe(), found)


def test_offset_expectation_is_the_truth_on_the_cuda_path():
    """Item 6: at a mean 1e4 standard deviations from zero the CUDA path normalizes with a float32 mean,
    as native CUDA BatchNorm does: more than the CPU's 1e-5, within the expectation stated for CUDA."""
    case = Case((4, 4), shape=(4, 8, 8), offset=1e4)
    for errors in run_world(_parity, 2, [case]):
        worst = max(errors[0].values())
        assert tolerance(case, 2, "cpu") < worst <= tolerance(case, 2, "cuda"), errors


def _outcome(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        return type(error).__name__, str(error).splitlines()[0]
    return None


def _rejected(rank, world_size):
    """Rank 1 gives the wrong channel count; rank 0 learns it from the reduced flag at check_sync()."""
    with cuda_path_on_cpu():
        torch.manual_seed(0)
        layer = distsync.DistSyncBatchNorm2d(3, momentum=None)
        good = _outcome(lambda: layer(torch.randn(4, 3, 2, 2)).sum().backward())
        distsync.check_sync()
        x = torch.randn(4, 3 if rank == 0 else 5, 2, 2)
        at_call = _outcome(lambda: layer(x))
        later = _outcome(distsync.check_sync)
        return good, at_call, later, int(layer.num_batches_tracked), layer.running_var.tolist()


def test_rejected_input_raises_on_every_rank_and_counts_on_none():
    (good0, call0, later0, n0, var0), (good1, call1, later1, n1, var1) = run_world(_rejected, 2)
    assert good0 is good1 is None
    assert call1[0] == "ValueError" and "expected 3 channels" in call1[1]
    assert call0 is None and later0[0] == "SyncError" and "rejected their input" in later0[1]
    # Item 7: num_batches_tracked counts the good call only, on both ranks; running stats stay equal.
    assert n0 == n1 == 1
    assert var0 == var1


def _out_of_step(rank, world_size, calls):
    """Both ranks sync 2 layers of one width; at call 3 rank 1 calls the other one. Returns the index of
    the call at which each rank raised."""
    with cuda_path_on_cpu():
        model = torch.nn.Sequential(distsync.DistSyncBatchNorm1d(4), distsync.DistSyncBatchNorm1d(4))
        for index in range(calls):
            which = 1 if (index == 3 and rank == 1) else 0
            try:
                model[which](torch.randn(6, 4))
            except SyncMismatchError as error:
                return index, str(error)
        try:
            distsync.check_sync()
        except SyncMismatchError as error:
            return calls, str(error)
        return None


@pytest.mark.parametrize("calls", [6, 30])
def test_out_of_step_ranks_raise_the_same_error_at_the_same_call(calls):
    first, second = run_world(_out_of_step, 2, calls)
    # Decided from call counts: the verdict of call 3 is read at the second multiple of the lag after it
    # (call index 2 * lag - 1), or by check_sync() if the ranks stop before.
    expected = min(calls, 2 * _health._LAG - 1)
    assert first[0] == second[0] == expected, (first, second)
    # Each rank names its own side of the mismatch (rank 1 synced the other layer's first call).
    assert "forward call #3" in first[1] and "forward call #0" in second[1]
    assert "disagree on layer, call count" in first[1] and "disagree on layer, call count" in second[1]


def _single_value(rank, world_size):
    with cuda_path_on_cpu():
        layer = distsync.DistSyncBatchNorm1d(3)
        out = layer(torch.randn(1 - rank, 3))  # one value per channel over both ranks
        out.sum().backward()
        return _outcome(distsync.check_sync)


def test_single_value_per_channel_raises_on_every_rank():
    outcomes = run_world(_single_value, 2)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "ValueError" and "more than 1 value per channel" in outcomes[0][1]


def test_emulated_ops_raise_where_the_cuda_kernels_do():
    """The emulation keeps the CUDA kernels' checks: the path must pass them, so they must be able to fail."""
    from cuda_emulation import EmulatedCudaOps as ops

    x = torch.randn(4, 3, 2)
    mean, var = ops.batch_norm_update_stats(x, None, None, 0.0)
    invstd = var.rsqrt()
    with pytest.raises(RuntimeError, match="Int"):
        ops.batch_norm_backward_elemt(x, x, mean, invstd, None, mean, mean, torch.tensor([4, 4]))
    with pytest.raises(RuntimeError, match="same data types"):
        ops.batch_norm_backward_reduce(x, x, mean, invstd.double(), None, True, False, False)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        ops.batch_norm_elemt(x, None, None, mean.double(), invstd.double(), 1e-5)


def _captured(rank, world_size, steps):
    """Steps 'captured' (the runtime says a capture is under way) then checked by check_sync(); at the
    last captured step rank 1 calls the other layer."""
    from distsync.testing.cuda_trace import fake_runtime

    with cuda_path_on_cpu(), fake_runtime() as runtime:
        model = torch.nn.Sequential(distsync.DistSyncBatchNorm1d(4), distsync.DistSyncBatchNorm1d(4))
        runtime.capturing_now = True
        for step in range(steps):
            which = 1 if (rank == 1 and step == steps - 1) else 0
            model[which](torch.randn(6, 4, requires_grad=True)).sum().backward()
        runtime.capturing_now = False
        host_work = list(runtime.launches) + list(runtime.events)
        return host_work, len(_health._monitor._captured), _outcome(distsync.check_sync)


def test_captured_calls_do_no_host_work_and_are_checked_by_check_sync():
    """Item 4 in CI: the capture branch queues nothing and waits for nothing over 12 captured calls (more
    than the lag); check_sync() reads the captured calls' tails and raises on every rank."""
    for host_work, captured, outcome in run_world(_captured, 2, 6):
        assert host_work == [] and captured == 12
        assert outcome[0] == "SyncMismatchError"


def _runtime_pending(ready_after: int):
    """A monitor fed 2 * lag CPU tails with fake streams whose events are ready after ``ready_after``."""
    from distsync._syncbn import payload as _payload
    from distsync.testing.cuda_trace import FakeRuntime

    class Slow(FakeRuntime):
        def record(self, stream):
            event = super().record(stream)
            event.ready_after = ready_after
            return event

    runtime = Slow()
    monitor = _health._Monitor()
    state = _payload.SyncState("'bn' (DistSyncBatchNorm)")
    state.identity = 7
    payloads = []
    for _ in range(2 * _health._LAG):
        tag = state.next_tag(_payload.FORWARD)
        row = state.tail(tag, 2, True, torch.device("cpu"), 1)
        payloads.append((row[row.numel() - _payload.TAIL :] * 2, tag))
    return runtime, monitor, payloads


def test_verdicts_wait_for_the_copy_instead_of_polling(monkeypatch):
    """Item 3: the copy of a call is waited for at a fixed call, however late the device is. Readiness
    polling would skip a copy that is not ready yet and raise at a later call on a slower rank."""
    runtime, monitor, payloads = _runtime_pending(ready_after=50)
    monkeypatch.setattr(_health, "runtime", runtime)
    payloads[2][0][1] = 2.0  # call 2: both ranks 'rejected' their input (the failed slot of the tail)
    raised_at = None
    for index, (tail, tag) in enumerate(payloads):
        try:
            monitor.defer(_health._Pending(tail, tag, 2, True, 60.0))
        except SyncError:
            raised_at = index
            break
    assert raised_at == 2 * _health._LAG - 1
    assert runtime.events[0].queries > 50  # it waited for the late copy


def test_a_copy_that_never_lands_raises_sync_error_naming_the_calls(monkeypatch):
    """A peer that left the collectives keeps the copy from landing: after half the process group's
    timeout the wait raises SyncError naming the layer and calls (on NCCL as on gloo), not a hang."""
    runtime, monitor, payloads = _runtime_pending(ready_after=10**9)
    monkeypatch.setattr(_health, "runtime", runtime)
    with pytest.raises(SyncError, match=r"'bn' \(DistSyncBatchNorm\), forward call #0 to .*forward call #7"):
        for tail, tag in payloads:
            monitor.defer(_health._Pending(tail, tag, 2, True, 0.05))


def _generic(rank, world_size, cases):
    with _kernels.routed("cpu", _kernels.GenericKernels):
        _health._monitor.__init__()
        return [run_case(case, rank) for case in cases]


def test_generic_path_for_other_accelerators_matches_batchnorm():
    """Item 5: the path of MPS/XPU/... (ops every backend has) on CPU tensors, checked like the others."""
    assert _kernels.kernels_for(torch.device("mps")) is _kernels.GenericKernels
    assert _kernels.kernels_for(torch.device("cuda")) is _kernels.CudaKernels
    cases = default_cases(2)
    for errors in run_world(_generic, 2, cases):
        for case, found in zip(cases, errors, strict=True):
            assert max(found.values()) <= tolerance(case, 2, "cpu"), (case.describe(), found)


def test_tails_of_two_streams_are_copied_on_their_own_streams(monkeypatch):
    """Items 1 and 2 in CI: calls made under two streams are queued apart; each copy is issued on the
    stream that produced its tails and its event recorded there."""
    runtime, monitor, payloads = _runtime_pending(ready_after=0)
    monkeypatch.setattr(_health, "runtime", runtime)
    for index, (tail, tag) in enumerate(payloads[: _health._LAG]):
        runtime.streams["cpu"] = "side" if index % 2 else "default"
        monitor.defer(_health._Pending(tail, tag, 2, True, 60.0))
    half = _health._LAG // 2
    assert sorted(runtime.launches) == [("cpu", "default", half), ("cpu", "side", half)]
    assert sorted(event.stream for event in runtime.events) == ["default", "side"]


def _under_default_device(rank, world_size, default):
    """``_LAG + 3`` calls and ``check_sync()`` with ``default`` as torch's default device (None: unset):
    the monitor copies tails in the call that makes ``_LAG`` (inside the autograd Function, where torch's
    default device does not reach) and, for the last three, in ``check_sync()``, where it does."""
    torch.manual_seed(rank)
    layer = distsync.DistSyncBatchNorm2d(4)
    x = torch.randn(4, 4, 3, 3)
    with cuda_path_on_cpu():
        torch.set_default_device(default)
        try:
            outcome = _outcome(lambda: [layer(x) for _ in range(_health._LAG + 3)] and distsync.check_sync())
        finally:
            torch.set_default_device(None)
    return outcome, layer.running_mean


def test_deferred_checks_copy_to_the_host_whatever_the_default_device():
    """A GPU user's ``torch.set_default_device("cuda")`` (meta stands in for it here) does not move the
    buffer the deferred checks copy the reduced tails into off the host: the checks run and the layer
    trains as with no default device."""
    for (outcome, running_mean), (_, expected) in zip(
        run_world(_under_default_device, 2, "meta"), run_world(_under_default_device, 2, None), strict=True
    ):
        assert outcome is None, outcome
        assert torch.equal(running_mean, expected)
