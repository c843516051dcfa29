"""What the parts of the GPU check share: where they run, how they record findings, one-rank worlds.

A part is a function ``run(findings, device)``; ``device`` is ``"cuda"`` on a machine with a GPU and
``"cpu"`` elsewhere, where a part that can runs a smaller version of itself (the dry run). Findings are
pass/fail checks with their numbers, named figures, tables and notes; :mod:`check` writes them to the report.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "tests")]  # the parts, and the CPU tests' helpers some of them reuse

import _vision  # noqa: E402  (tests/_vision.py: a no-op where torchvision's compiled ops load)

_vision.ensure_importable()
# The parts call bare layers in multi-rank worlds on purpose (no DDP): distsync's warning about it is noise.
warnings.filterwarnings("ignore", "distsync: the synchronized layer", RuntimeWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distsync.testing import free_port, timeout_scale  # noqa: E402


class Findings:
    """What one part found: checks (name, passed, detail), figures, tables and notes, in order."""

    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, float | str | None] = {}
        self.tables: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append({"name": name, "passed": bool(passed), "detail": detail})
        return bool(passed)

    def within(self, name: str, error: float, limit: float) -> bool:
        """A relative error against its tolerance, as a check."""
        return self.check(name, error <= limit, f"max rel. error {error:.1e} (tol {limit:.0e})")

    def figure(self, name: str, value: float | str | None) -> None:
        self.figures[name] = value

    def table(self, title: str, header: list[str], rows: list[list[Any]]) -> None:
        self.tables.append({"title": title, "header": header, "rows": rows})

    def note(self, text: str) -> None:
        self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        return {"checks": self.checks, "figures": self.figures, "tables": self.tables, "notes": self.notes}


def rank_device(device: str, rank: int = 0) -> torch.device:
    """This rank's device: ranks share the GPUs there are (2 ranks on one GPU talk over gloo)."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def quick(device: str) -> bool:
    """The dry run on the CPU: fewer repetitions, smaller models."""
    return device == "cpu"


def limit_scale(device: str) -> float:
    """What the check's time limits are multiplied by: 1 on a GPU, where the whole check must fit the time
    the machine is lent for; in the dry run on the CPU, the test suite's factor
    (:func:`distsync.testing.timeout_scale`: ``DISTSYNC_TEST_TIMEOUT_SCALE``, else the load per core), so
    a busy machine makes the dry run slower, not failed."""
    return 1.0 if device == "cuda" else timeout_scale()


@contextlib.contextmanager
def one_rank_world(device: str) -> Iterator[None]:
    """A world of this process alone: NCCL on a GPU (its collectives are real, asynchronous and capturable),
    gloo on the CPU."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    url = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group(backend, init_method=url, rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


class GroupOfOne:
    """A synchronized layer's transport over the default one-rank group: the layer takes its whole
    synchronized path (payload, all-reduce, merged statistics, device-side verdicts) where it would
    otherwise see nobody to sync with and run plain BatchNorm. The all-reduce is the backend's own (NCCL on
    a GPU): what the layer costs without another rank's data to wait for."""

    world_size, first, timeout = 1, True, None

    def all_reduce(self, payload: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(payload)
        return payload

    def announce(self, call: Any) -> None:  # nobody joined (distsync.join): nothing to announce
        pass


class Twin:
    """A transport for one process that stands for a world of two ranks with the same batch (the payload
    doubled); from call ``disagree_at`` on, the twin sends a different payload: a peer out of step."""

    world_size, first, timeout = 2, True, None

    def __init__(self, disagree_at: int | None = None) -> None:
        self.calls, self.disagree_at = 0, disagree_at

    def all_reduce(self, payload: torch.Tensor) -> torch.Tensor:
        payload.mul_(2)
        if self.disagree_at is not None and self.calls >= self.disagree_at:
            payload.add_(1)
        self.calls += 1
        return payload

    def announce(self, call: Any) -> None:
        pass


def set_transport(model: torch.nn.Module, make: Callable[[], Any]) -> int:
    """Give every synchronized layer of ``model`` its own transport from ``make``; returns how many.

    Test code: the attribute is the hook :class:`distsync.parallel.ReplicationCallbackDataParallel` wires
    its replicas through (``benchmarks/_layer_bench.py`` and the CPU tests use it the same way).
    """
    import distsync

    layers = [m for m in model.modules() if isinstance(m, distsync.DistSyncBatchNorm)]
    for layer in layers:
        layer._replica_reducer = make()
    return len(layers)


def plain_convnet(width: int = 16) -> torch.nn.Module:
    """A conv net with the kinds of BN the synchronized layer replaces: 2d with momentum 0.1 and None, 1d,
    and ``bn_subclasses.ActNorm2d`` (a BatchNorm2d subclass with its own forward, as timm writes them)."""
    from bn_subclasses import ActNorm2d
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.BatchNorm2d(width, momentum=None),
        ActNorm2d(width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
        nn.BatchNorm1d(10),
    )


def small_convnet(width: int = 16) -> torch.nn.Module:
    """:func:`plain_convnet`, converted by distsync."""
    import distsync

    return distsync.convert_sync_batchnorm(plain_convnet(width))


class TorchSyncPath(torch.nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` taking its synchronized path (its autograd Function over the default group) in
    any world, a one-rank one too, where the module itself would run plain BatchNorm: what it costs and
    does per call, measured beside distsync's. ``torch.nn.modules._functions.SyncBatchNorm`` is torch's
    private Function, stable in signature from torch 2.0 to 2.14."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        from torch.nn.modules._functions import SyncBatchNorm as function

        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return function.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, factor,
            dist.group.WORLD, dist.get_world_size(),
        )  # fmt: skip

    @classmethod
    def convert(cls, model: torch.nn.Module) -> torch.nn.Module:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        for module in model.modules():
            if type(module) is torch.nn.SyncBatchNorm:
                module.__class__ = cls
        return model


def relative_error(actual: torch.Tensor, expected: torch.Tensor, unit: float = 0.0) -> float:
    """Norm of the difference over the reference's norm, on the CPU in float64 (0 for empty tensors).

    With ``unit`` > 0, over at least the norm of entries of that size: for quantities that cancel to
    rounding noise in exact arithmetic (the running mean of a layer fed by another BN layer's output).
    """
    if expected.numel() == 0:
        return 0.0
    difference = (actual.detach().double().cpu() - expected.detach().double().cpu()).norm().item()
    scale = max(expected.detach().double().norm().item(), unit * expected.numel() ** 0.5, 1e-300)
    return difference / scale


def model_errors(reference: torch.nn.Module, model: torch.nn.Module) -> dict[str, float]:
    """``model``'s parameter gradients and buffers against ``reference``'s (one architecture), by name."""
    found = {}
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
        found[f"{name} grad"] = relative_error(actual.grad, expected.grad)
    for (name, expected), actual in zip(reference.named_buffers(), model.buffers(), strict=True):
        found[name] = relative_error(actual, expected, unit=1.0)  # a running mean after BN is ~0
    return found


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_per_call(fn: Callable[[], None], device: str, calls: int, repeats: int) -> tuple[float, float]:
    """(median wall seconds per call, median CPU seconds of this thread per call) over ``repeats`` runs of
    ``calls`` calls, the device drained before and after each run."""
    walls, cpus = [], []
    for _ in range(repeats):
        synchronize(device)
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        cpu = time.thread_time() - cpu
        synchronize(device)
        walls.append((time.perf_counter() - wall) / calls)
        cpus.append(cpu / calls)
    return sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]


def environment() -> dict[str, Any]:
    """The machine and software the report was made on."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            device_memory_gib=round(properties.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            nccl=".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None,
        )
    else:
        info["device"] = "cpu (dry run)"
    return info


def fmt(seconds: float) -> str:
    """A duration per call, in the unit that keeps it readable."""
    if math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"
