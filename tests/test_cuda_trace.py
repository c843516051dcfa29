"""The CUDA path's structure, traced without a GPU (needs a CUDA build of torch; skipped otherwise).

Under FakeTensorMode every op dispatches as on a GPU without running, and any host sync raises. See
docs/performance.md ("The CUDA path, traced") for how to run this file.
"""

import pytest
import torch
from bn_subclasses import ActNorm2d

from distsync._syncbn import health as _health
from distsync.testing import cuda_trace as _trace

pytestmark = pytest.mark.skipif(
    not (torch.version.cuda and _trace.SUPPORTED), reason="needs a CUDA build of torch >= 2.11 (not a GPU)"
)

FORWARD_OPS, BACKWARD_OPS = 17, 5  # momentum=None adds one (the weight 1 / num_batches_tracked)
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


def trace_layer(shape, dtype=torch.float32, channels_last=False, momentum=0.1, subclass=False):
    """Forward and backward traces of one synced call on fake CUDA tensors in a fake 2-rank NCCL world
    (with ``subclass``, of a converted BatchNormAct-style subclass)."""
    import distsync
    from distsync.testing.cuda_trace import fake_cuda_world, record

    _health._monitor.__init__()
    with fake_cuda_world(2):
        if subclass:
            with torch.device("cuda"):
                layer = distsync.convert_sync_batchnorm(ActNorm2d(shape[1], momentum=momentum))
        else:
            layer = distsync.DistSyncBatchNorm(shape[1], momentum=momentum, device="cuda")
        x = torch.randn(shape, device="cuda", dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        x.requires_grad_()
        warm_up = layer(x.detach().requires_grad_())  # first calls build the device-side tail tables
        _backward(warm_up, torch.randn_like(warm_up))
        with record(x.numel()) as forward:
            out = layer(x)
        dy = torch.randn_like(out)
        with record(x.numel()) as backward:
            grads = _backward(out, dy)
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


def _backward(output, grad):
    """Run the backward nodes from ``output`` down to the synced layer's, on this thread (where the
    trace records; the autograd engine would run CUDA nodes on its own threads)."""
    node = output.grad_fn
    while not hasattr(node, "apply"):  # the subclass's own ops after the normalization
        grads = node(grad)  # a tuple, or the one gradient itself
        grad, node = grads[0] if isinstance(grads, tuple) else grads, node.next_functions[0][0]
    return node.apply(grad)


# What ActNorm2d's own ops add around its F.batch_norm call: forward, two counters, SiLU and the gain's
# product; backward, that product's two gradients and SiLU's backward (8 ATen ops on fake CUDA tensors).
SUBCLASS_FORWARD_OPS, SUBCLASS_BACKWARD_OPS = 4, 10


# (momentum=None is left out: like _BatchNorm's forward, ActNorm2d reads 1 / num_batches_tracked on the host)
@pytest.mark.parametrize("case", ["fp32 2d", "bf16 input", "fp16 input", "fp32 channels_last"])
def test_a_converted_subclass_keeps_the_cuda_path(case):
    """The routed F.batch_norm call of a converted subclass takes the same path: no host sync, one
    all-reduce each way, the layer's budget plus what the subclass's own ops add."""
    forward, backward = trace_layer(**CASES[case], subclass=True)
    assert forward.host_transfers == [] and backward.host_transfers == []
    assert [op for op, _ in forward.collectives] == ["c10d.allreduce_.default"]
    assert [op for op, _ in backward.collectives] == ["c10d.allreduce_.default"]
    assert len(forward.ops) <= FORWARD_OPS + SUBCLASS_FORWARD_OPS, forward.ops
    assert len(backward.ops) <= BACKWARD_OPS + SUBCLASS_BACKWARD_OPS, backward.ops
    assert "aten.batch_norm_elemt.default" in forward.ops


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

    from distsync.testing.cuda_trace import fake_cuda_world

    with fake_cuda_world(2), pytest.raises(DataDependentOutputException):
        torch.ones(3, device="cuda").sum().item()


def _synced_calls(layers, devices, steps):
    """Forward and backward (through grad_fn) of each layer on its device, ``steps`` times."""
    for _ in range(steps):
        for layer, device in zip(layers, devices, strict=True):
            out = layer(torch.randn(4, layer.num_features, 2, 2, device=device).requires_grad_())
            out.grad_fn.apply(torch.randn_like(out))


def test_several_gpus_in_one_process_are_checked_per_device_and_stream():
    """Items 1 and 2: tails on two GPUs are copied per device, on the stream that produced them (here a
    side stream on cuda:1, used without set_device), each behind an event recorded on that stream."""
    import distsync
    from distsync.testing.cuda_trace import fake_cuda_world

    _health._monitor.__init__()
    with fake_cuda_world(2):
        runtime = _health.runtime
        runtime.streams["cuda:1"] = "side stream of cuda:1"
        devices = ["cuda:0", "cuda:1"]
        layers = [distsync.DistSyncBatchNorm2d(3, device=device) for device in devices]
        _synced_calls(layers, devices, steps=2)  # 8 deferred calls: one launch
        launches, events = list(runtime.launches), [event.stream for event in runtime.events]
    _health._monitor.__init__()
    assert sorted(launches) == [("cuda:0", "cuda:0:default", 4), ("cuda:1", "side stream of cuda:1", 4)]
    assert sorted(events) == ["cuda:0:default", "side stream of cuda:1"]


def test_capture_does_no_host_work_and_keeps_the_trace():
    """Item 4: while a CUDA graph is captured, synced calls queue, copy, record and query nothing (here 3
    training steps, more than one lag of calls), and stay within the trace budget."""
    import distsync
    from distsync.testing.cuda_trace import fake_cuda_world, record

    _health._monitor.__init__()
    with fake_cuda_world(2):
        runtime = _health.runtime
        layer = distsync.DistSyncBatchNorm2d(16, device="cuda")
        _synced_calls([layer], ["cuda"], steps=1)  # warm-up outside the capture, as torch requires
        runtime.capturing_now = True
        x = torch.randn(8, 16, 6, 6, device="cuda", requires_grad=True)
        with record(x.numel()) as forward:
            layer(x)
        _synced_calls([layer], ["cuda"], steps=4)
        captured = len(_health._monitor._captured)
        runtime.capturing_now = False
    _health._monitor.__init__()
    assert runtime.launches == [] and runtime.events == []
    assert captured == 1 + 2 * 4
    assert forward.host_transfers == [] and len(forward.ops) <= FORWARD_OPS


def test_fullgraph_compile_traces_on_fake_cuda():
    """Item 8 on the CUDA build: dynamo traces a model with a synchronized layer on fake CUDA tensors in
    one graph (fullgraph), with one functional all-reduce each way and no host read (any would raise here)."""
    import distsync
    from distsync.testing.cuda_trace import fake_cuda_world

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with fake_cuda_world(2):
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, device="cuda"), distsync.DistSyncBatchNorm2d(8, device="cuda")
        )
        out = torch.compile(model, fullgraph=True, backend=backend)(torch.randn(4, 3, 8, 8, device="cuda"))
    assert out.device.type == "cuda" and out.shape == (4, 8, 6, 6)
    assert len(graphs) == 1
    graph_modules = [module for module in graphs[0].modules() if isinstance(module, torch.fx.GraphModule)]
    nodes = [node for module in graph_modules for node in module.graph.nodes]
    collectives = [str(node.target) for node in nodes if "c10d" in str(node.target)]
    # the bodies of the autograd function around the all-reduce: its forward and its backward, one each
    assert collectives == ["_c10d_functional.all_reduce", "_c10d_functional.wait_tensor"] * 2
