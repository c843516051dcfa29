"""Trace the CUDA path of a synchronized layer on a machine without a GPU.

With a CUDA build of torch, ``FakeTensorMode`` makes CUDA tensors that dispatch every op as on a GPU
without running it, and the ``fake`` process-group backend stands in for NCCL. Any host sync then raises
``DataDependentOutputException``. The autograd engine needs a real device, so backward is traced by
calling the output's ``grad_fn`` directly. PyTorch has no meta kernels for the ``batch_norm_*`` ops the
CUDA path uses; :func:`fake_cuda_world` registers shape-only ones for the trace.

Used by ``tests/test_cuda_trace.py`` and ``benchmarks/cuda_trace.py`` (which also traces
``nn.SyncBatchNorm``, whose ``batch_norm_stats`` and ``batch_norm_gather_stats_with_counts`` get
shape-only kernels here too). Without a driver no stream, event or capture query can run either:
:func:`fake_runtime` stands in for the few runtime calls of ``distsync._syncbn.health``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_VIEWS = {"view", "_unsafe_view", "as_strided", "select", "slice", "unsqueeze", "expand", "unbind", "t"}
_COLLECTIVES = ("c10d.", "_c10d_functional.")


@dataclass
class Trace:
    """What one call dispatched: ATen ops (views excluded), collectives, and passes over the activation."""

    ops: list[str] = field(default_factory=list)
    collectives: list[tuple[str, int]] = field(default_factory=list)  # (op, bytes)
    activation_passes: int = 0
    host_transfers: list[str] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, activation_numel: int) -> None:
        super().__init__()
        self.trace = Trace()
        self.numel = activation_numel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__qualname__ if hasattr(func, "overloadpacket") else func)
        full = str(func)
        result = func(*args, **kwargs)
        flat_in = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        flat_out = [r for r in torch.utils._pytree.tree_leaves(result) if isinstance(r, torch.Tensor)]
        if full.startswith(_COLLECTIVES):
            payload = flat_in[0]
            self.trace.collectives.append((full, payload.numel() * payload.element_size()))
            return result
        if not full.startswith("aten.") or name.split(".")[-1] in _VIEWS or func.is_view:
            return result
        self.trace.ops.append(full)
        devices = {t.device.type for t in flat_in + flat_out if t.dim() > 0}
        if "cpu" in devices and "cuda" in devices:
            self.trace.host_transfers.append(full)
        touched = {id(t) for t in flat_in + flat_out if t.numel() == self.numel}
        self.trace.activation_passes += len(touched)
        return result


@contextlib.contextmanager
def record(activation_numel: int) -> Iterator[Trace]:
    recorder = _Recorder(activation_numel)
    with recorder:
        yield recorder.trace


def _register_fake_kernels(library: torch.library.Library) -> None:
    """Shape-only Meta kernels for the CUDA batch-norm ops (none ship with PyTorch)."""

    def acc(x: torch.Tensor) -> torch.dtype:
        return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype

    def update_stats(x, running_mean, running_var, momentum):
        c = x.shape[1]
        return x.new_empty(c, dtype=acc(x)), x.new_empty(c, dtype=acc(x))

    def elemt(x, weight, bias, mean, invstd, eps):
        return torch.empty_like(x)

    def backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
        c = x.shape[1]
        grad_weight = weight.new_empty(c) if weight_g else None
        grad_bias = (mean if weight is None else weight).new_empty(c) if bias_g else None
        return mean.new_empty(c), mean.new_empty(c), grad_weight, grad_bias

    def backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        assert count.dtype == torch.int32, "batch_norm_backward_elemt reads count as int32"
        assert mean.dtype == invstd.dtype == sum_dy.dtype == sum_dy_xmu.dtype, "stat dtypes differ"
        return torch.empty_like(dy)

    def stats(x, eps):
        c = x.shape[1]
        return x.new_empty(c, dtype=acc(x)), x.new_empty(c, dtype=acc(x))

    def gather_stats(x, mean, invstd, running_mean, running_var, momentum, eps, counts):
        return mean.new_empty(mean.shape[1]), mean.new_empty(mean.shape[1])

    library.impl("batch_norm_stats", stats, "Meta")
    library.impl("batch_norm_gather_stats_with_counts", gather_stats, "Meta")
    library.impl("batch_norm_update_stats", update_stats, "Meta")
    library.impl("batch_norm_elemt", elemt, "Meta")
    library.impl("batch_norm_backward_reduce", backward_reduce, "Meta")
    library.impl("batch_norm_backward_elemt", backward_elemt, "Meta")


class FakeEvent:
    """Stands for a CUDA event: which stream it was recorded on; ready after ``ready_after`` queries."""

    def __init__(self, stream, ready_after: int = 0) -> None:
        self.stream, self.queries, self.ready_after = stream, 0, ready_after

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.ready_after


class FakeRuntime:
    """The runtime calls of ``distsync._syncbn.health`` without a driver: streams are named, events are
    :class:`FakeEvent`, capture is off unless ``capturing`` is set; ``launches`` logs every copy."""

    def __init__(self) -> None:
        self.capturing_now = False
        self.streams: dict = {}  # device -> current stream name
        self.launches: list[tuple[str, str, int]] = []  # (tails' device, stream made current, calls)
        self.events: list[FakeEvent] = []
        self._current = None

    def capturing(self, device) -> bool:
        return self.capturing_now

    def current_stream(self, device):
        return self.streams.get(str(device), f"{device}:default")

    @contextlib.contextmanager
    def on(self, stream):
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def host_buffer(self, like):
        self.launches.append((str(like.device), self._current, like.shape[0]))
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")

    def record(self, stream):
        event = FakeEvent(stream)
        self.events.append(event)
        return event


@contextlib.contextmanager
def fake_runtime() -> Iterator[FakeRuntime]:
    """Route ``distsync._syncbn.health``'s runtime calls to a :class:`FakeRuntime` inside the block."""
    from distsync._syncbn import health as _health

    runtime, previous = FakeRuntime(), _health.runtime
    _health.runtime = runtime
    try:
        yield runtime
    finally:
        _health.runtime = previous


_library: torch.library.Library | None = None


# Releases whose fake CUDA tensors dispatch without a driver (validated: 2.11, 2.14); 2.4 and 2.6 start the
# CUDA runtime in FakeTensorMode and abort the process on a machine without a GPU.
SUPPORTED = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)


@contextlib.contextmanager
def fake_cuda_world(world_size: int = 2) -> Iterator[None]:
    """A fake NCCL world of ``world_size`` (this process is rank 0) and fake CUDA tensors."""
    global _library
    if not SUPPORTED:
        raise RuntimeError(f"the fake-CUDA trace needs torch >= 2.11 (this is {torch.__version__})")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if _library is None:
        _library = torch.library.Library("aten", "IMPL")
        _register_fake_kernels(_library)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with FakeTensorMode(allow_non_fake_inputs=False), fake_runtime():
            yield
    finally:
        dist.destroy_process_group()
