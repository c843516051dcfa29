"""The CUDA path's structure, traced without a GPU (needs a CUDA build of torch; skipped otherwise).

Under FakeTensorMode every op dispatches as on a GPU without running, and any host sync raises. See
docs/performance.md ("The CUDA path, traced") for how to run this file.
"""

import pytest
import torch

from distsync import _health

pytestmark = pytest.mark.skipif(not torch.version.cuda, reason="needs a CUDA build of torch (not a GPU)")

FORWARD_OPS, BACKWARD_OPS = 20, 8
FORWARD_PASSES, BACKWARD_PASSES = 3, 5

CASES = {
    "fp32 2d": dict(shape=(8, 16, 6, 6)),
    "fp32 channels_last": dict(shape=(8, 16, 6, 6), channels_last=True),
    "bf16 input": dict(shape=(8, 16, 6, 6), dtype=torch.bfloat16),
    "fp16 input": dict(shape=(8, 16, 6, 6), dtype=torch.float16),
    "fp32 1d": dict(shape=(8, 16, 10)),
    "fp32 3d": dict(shape=(4, 16, 3, 4, 5)),
    "fp32 3d channels_last": dict(shape=(4, 16, 3, 4, 5), channels_last=True),
    "momentum=None": dict(shape=(8, 16, 6, 6), momentum=None),
}


def trace_layer(shape, dtype=torch.float32, channels_last=False, momentum=0.1):
    """Forward and backward traces of one synced call on fake CUDA tensors in a fake 2-rank NCCL world."""
    import distsync
    from distsync._trace import fake_cuda_world, record

    _health._monitor.__init__()
    with fake_cuda_world(2):
        layer = distsync.DistSyncBatchNorm(shape[1], momentum=momentum, device="cuda")
        x = torch.randn(shape, device="cuda", dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        x.requires_grad_()
        warm_up = layer(x.detach().requires_grad_())  # first calls build the device-side tail tables
        warm_up.grad_fn.apply(torch.randn_like(warm_up))
        with record(x.numel()) as forward:
            out = layer(x)
        dy = torch.randn_like(out)
        with record(x.numel()) as backward:
            grads = out.grad_fn.apply(dy)
    _health._monitor.__init__()
    assert grads[0].shape == x.shape
    return forward, backward


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cuda_path_has_no_host_sync_and_stays_within_budget(case):
    forward, backward = trace_layer(**CASES[case])
    assert forward.host_transfers == [] and backward.host_transfers == []
    assert [op for op, _ in forward.collectives] == ["c10d.allreduce_.default"]
    assert [op for op, _ in backward.collectives] == ["c10d.allreduce_.default"]
    assert len(forward.ops) <= FORWARD_OPS, forward.ops
    assert len(backward.ops) <= BACKWARD_OPS, backward.ops
    assert forward.activation_passes <= FORWARD_PASSES, forward.ops
    assert backward.activation_passes <= BACKWARD_PASSES, backward.ops


def test_cuda_path_uses_the_cuda_batch_norm_kernels():
    forward, backward = trace_layer((8, 16, 6, 6))
    assert "aten.batch_norm_update_stats.default" in forward.ops
    assert "aten.batch_norm_elemt.default" in forward.ops
    assert "aten.batch_norm_backward_reduce.default" in backward.ops
    assert "aten.batch_norm_backward_elemt.default" in backward.ops
    assert not any("native_batch_norm" in op for op in forward.ops + backward.ops)


def test_a_host_read_in_the_traced_path_would_be_caught():
    """The trace can fail: reading a fake CUDA value raises, as a host sync would stall a GPU."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from distsync._trace import fake_cuda_world

    with fake_cuda_world(2), pytest.raises(DataDependentOutputException):
        torch.ones(3, device="cuda").sum().item()
