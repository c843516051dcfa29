"""Self-check: does synchronized batch norm equal BatchNorm on the global batch on this machine?

Run ``python -m distsync.check --nproc 2``. It spawns gloo workers and compares :class:`DistSyncBatchNorm`
on each rank's slice with float64 ``nn.BatchNorm`` on the concatenated batch: outputs, input gradients,
summed parameter gradients and running statistics over several steps, then eval-mode outputs.

``python -m distsync.check --shim --nproc 2`` checks the ``nn.DataParallel`` shim the same way, on the CPU:
copies of the layer made and wired as ``distsync.parallel``'s DataParallel makes them on that many GPUs, each
running in a thread of its own (see :func:`run_shim_case`). Without CUDA, ``nn.DataParallel`` calls the
module itself, so this is how a CPU machine checks the shim's arithmetic.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from distsync._syncbn.health import check_sync
from distsync.batchnorm import (
    DistSyncBatchNorm,
    DistSyncBatchNorm1d,
    DistSyncBatchNorm2d,
    DistSyncBatchNorm3d,
)
from distsync.parallel.replicate import exec_data_parallel_replication_callback
from distsync.testing import WorkerFailed, run_threads, run_world

_CLASSES = {
    2: (nn.BatchNorm1d, DistSyncBatchNorm1d),
    3: (nn.BatchNorm1d, DistSyncBatchNorm1d),
    4: (nn.BatchNorm2d, DistSyncBatchNorm2d),
    5: (nn.BatchNorm3d, DistSyncBatchNorm3d),
}
# (output / grads, running stats) tolerance, relative to the reference's norm
_TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 2e-2,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: a global batch split over ranks, the layer options and the input format."""

    sizes: tuple[int, ...]  # per-rank batch sizes; len(sizes) == world size
    shape: tuple[int, ...] = (4, 3, 3)  # (C, *spatial)
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    momentum: float | None = 0.1
    affine: bool = True
    track_running_stats: bool = True
    generic_class: bool = False  # DistSyncBatchNorm instead of the rank-checking 1d/2d/3d class
    offset: float = 0.0  # input mean in units of its standard deviation: far from zero tests the numerics
    steps: int = 3
    param_dtype: torch.dtype | None = None  # parameters and buffers; None: float32 (float64 for float64)

    def describe(self) -> str:
        flags = [
            str(self.dtype).removeprefix("torch."),
            "channels_last" if self.channels_last else "",
            f"momentum={self.momentum}" if self.momentum != 0.1 else "",
            "affine=False" if not self.affine else "",
            "no running stats" if not self.track_running_stats else "",
            "generic" if self.generic_class else "",
            f"mean={self.offset:g}" if self.offset else "",
            f"params={str(self.param_dtype).removeprefix('torch.')}" if self.param_dtype else "",
        ]
        return f"sizes={list(self.sizes)} shape=(N,{','.join(map(str, self.shape))}) " + " ".join(
            f for f in flags if f
        )


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Error relative to the reference's norm, or to unit-sized entries where the reference cancels to ~0
    (e.g. input gradients of a two-sample batch)."""
    if expected.numel() == 0:
        return 0.0
    scale = max(expected.norm().item(), expected.numel() ** 0.5)
    return (actual.detach().double().cpu() - expected).norm().item() / scale


def _layers(case: Case, gen: torch.Generator, device: str) -> tuple[nn.Module, DistSyncBatchNorm]:
    """The float64 reference layer of ``case`` and the synchronized layer, with the same affine parameters."""
    channels = case.shape[0]
    ref_cls, sync_cls = _CLASSES[len(case.shape) + 1]
    if case.generic_class:
        sync_cls = DistSyncBatchNorm
    options = dict(momentum=case.momentum, affine=case.affine, track_running_stats=case.track_running_stats)
    reference = ref_cls(channels, **options).double()
    param_dtype = case.param_dtype or (torch.float64 if case.dtype == torch.float64 else torch.float32)
    layer = sync_cls(channels, **options, device=device, dtype=param_dtype)
    if case.affine:
        with torch.no_grad():
            reference.weight.copy_(torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5)
            reference.bias.copy_(torch.randn(channels, generator=gen, dtype=torch.float64))
            layer.weight.copy_(reference.weight)
            layer.bias.copy_(reference.bias)
    return reference, layer


def _global_batch(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's global input (channels of random scales, ``case.offset`` from zero) and output gradient."""
    ndim = len(case.shape) + 1
    scale = torch.rand(case.shape[0], generator=gen, dtype=torch.float64) * 3 + 0.1
    global_x = torch.randn(sum(case.sizes), *case.shape, generator=gen, dtype=torch.float64)
    global_x = ((global_x + case.offset) * scale.view(1, -1, *[1] * (ndim - 2))).to(case.dtype)
    global_dy = torch.randn(global_x.shape, generator=gen, dtype=torch.float64).to(case.dtype)
    return global_x, global_dy


def _memory_format(case: Case) -> torch.memory_format:
    ndim = len(case.shape) + 1
    if case.channels_last and ndim in (4, 5):
        return torch.channels_last if ndim == 4 else torch.channels_last_3d
    return torch.contiguous_format


def _check_output(x: torch.Tensor, out: torch.Tensor, memory_format: torch.memory_format) -> None:
    if out.dtype != x.dtype or out.shape != x.shape or not out.is_contiguous(memory_format=memory_format):
        raise AssertionError(f"output {out.dtype} {out.stride()} differs from input {x.dtype} {x.stride()}")


def _record(errors: dict[str, float], name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    errors[name] = max(errors.get(name, 0.0), _relative_error(actual, expected))


def _record_layer(
    errors: dict[str, float], prefix: str, layer: nn.Module, reference: nn.Module, sum_grad
) -> None:
    """Parameter gradients (summed over the participants by ``sum_grad``, then cleared) and running
    statistics."""
    if layer.affine:
        for name in ("weight", "bias"):
            grad = sum_grad(getattr(layer, name).grad.clone())
            _record(errors, f"{prefix}{name} grad", grad, getattr(reference, name).grad)
            getattr(layer, name).grad = None
            getattr(reference, name).grad = None
    if layer.track_running_stats:
        _record(errors, f"{prefix}running_mean", layer.running_mean, reference.running_mean)
        _record(errors, f"{prefix}running_var", layer.running_var, reference.running_var)
        if layer.num_batches_tracked.item() != reference.num_batches_tracked.item():
            raise AssertionError("num_batches_tracked differs from the reference")


def _steps(case: Case, gen: torch.Generator, reference: nn.Module, layer: nn.Module):
    """The steps of ``case``: ``case.steps`` in training, then one in eval mode, both layers switched to it
    first. Yields the step's prefix for the names of its errors, whether it trains, and its global batch
    and output gradient."""
    for step in range(case.steps + 1):
        training = step < case.steps
        reference.train(training)
        layer.train(training)
        yield ("" if training else "eval "), training, *_global_batch(case, gen)


def run_case(case: Case, rank: int, seed: int = 0, device: str = "cpu") -> dict[str, float]:
    """Run ``case`` on this rank of the current world; return the worst relative errors by quantity.

    The reference runs in float64 on the CPU; the synced layer runs on ``device``.
    """
    gen = torch.Generator().manual_seed(seed)
    reference, layer = _layers(case, gen, device)
    begin = sum(case.sizes[:rank])
    local = slice(begin, begin + case.sizes[rank])
    errors: dict[str, float] = {}
    for prefix, training, global_x, global_dy in _steps(case, gen, reference, layer):
        # Like nn.SyncBatchNorm, eval without running statistics normalizes each rank's own batch.
        own_batch = not training and not case.track_running_stats
        if own_batch and case.sizes[rank] * math.prod(case.shape[1:]) <= 1:
            break  # one value per channel: nn.BatchNorm refuses it, and so does the layer
        ref_rows, ref_local = (local, slice(None)) if own_batch else (slice(None), local)
        ref_x = global_x[ref_rows].to(torch.float64, copy=True).requires_grad_()
        ref_out = reference(ref_x)
        ref_out.backward(global_dy[ref_rows].double())
        memory_format = _memory_format(case)
        x = global_x[local].to(device, copy=True).to(memory_format=memory_format).requires_grad_()
        out = layer(x)
        out.backward(global_dy[local].to(device))
        check_sync()  # on GPUs, raise any deferred desync or bad-input error here
        _check_output(x, out, memory_format)
        _record(errors, f"{prefix}output", out.detach(), ref_out.detach()[ref_local])
        _record(errors, f"{prefix}input grad", x.grad, ref_x.grad[ref_local])
        _record_layer(errors, prefix, layer, reference, _own if own_batch else _summed_over_ranks)
    return errors


def _own(grad: torch.Tensor) -> torch.Tensor:
    return grad


def _summed_over_ranks(grad: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(grad)
    return grad


def _cpu_replicas(layer: DistSyncBatchNorm, copies: int) -> list[DistSyncBatchNorm]:
    """``copies`` copies of ``layer`` as ``nn.DataParallel`` replicates it onto that many GPUs, made on the
    CPU and wired by the replication callback: copy 0 holds the layer's own buffers, the others clones of
    them; every copy holds differentiable aliases of the layer's parameters (not parameters of its own), so
    that their gradients add up on the layer's parameters, as they do through DataParallel's broadcast."""
    replicas = []
    for index in range(copies):
        replica = layer.__new__(type(layer))
        replica.__dict__ = layer.__dict__.copy()
        replica._parameters = {}
        replica._buffers = {
            name: buffer if index == 0 or buffer is None else buffer.clone()
            for name, buffer in layer._buffers.items()
        }
        for name, parameter in layer._parameters.items():
            replica.__dict__[name] = None if parameter is None else parameter.view_as(parameter)
        replica._is_replica = True
        replicas.append(replica)
    exec_data_parallel_replication_callback(replicas)
    return replicas


def run_shim_case(case: Case, seed: int = 0) -> dict[str, float]:
    """Run ``case`` through the ``nn.DataParallel`` shim on the CPU; return the worst relative errors.

    One copy of the layer per entry of ``case.sizes``, made and wired as
    :class:`distsync.parallel.ReplicationCallbackDataParallel` makes them on that many GPUs (copy 0 holds the
    layer's buffers and alone updates them; every copy's parameter gradients add up on the layer's
    parameters), replicated again at every step. Each copy runs forward and backward on its chunk of the
    batch in a thread of its own, as DataParallel's devices do, meeting the others through the shim's replica
    transport. Compared, as :func:`run_case`, with float64 ``nn.BatchNorm`` on the whole batch.
    """
    gen = torch.Generator().manual_seed(seed)
    reference, layer = _layers(case, gen, "cpu")
    errors: dict[str, float] = {}
    memory_format = _memory_format(case)

    def forward_backward(replica: nn.Module, x: torch.Tensor, dy: torch.Tensor):
        x = x.to(memory_format=memory_format, copy=True).requires_grad_()
        out = replica(x)
        out.backward(dy)
        _check_output(x, out, memory_format)
        return out.detach(), x.grad

    for prefix, training, global_x, global_dy in _steps(case, gen, reference, layer):
        chunks, dy_chunks = global_x.split(case.sizes), global_dy.split(case.sizes)
        own_batch = not training and not case.track_running_stats  # each copy normalizes its own chunk
        if own_batch and min(case.sizes) * math.prod(case.shape[1:]) <= 1:
            break  # one value per channel: nn.BatchNorm refuses it, and so does the layer
        ref_x = global_x.to(torch.float64, copy=True).requires_grad_()
        ref_chunks = ref_x.split(case.sizes) if own_batch else [ref_x]
        ref_out = torch.cat([reference(chunk) for chunk in ref_chunks])
        ref_out.backward(global_dy.double())
        replicas = _cpu_replicas(layer, len(case.sizes))
        calls = [
            lambda r=r, x=x, dy=dy: forward_backward(r, x, dy)
            for r, x, dy in zip(replicas, chunks, dy_chunks, strict=True)
        ]
        results, failures = run_threads(calls)
        if failures:
            raise next(iter(failures.values()))
        outputs, input_grads = zip(*(results[index] for index in range(len(replicas))), strict=True)
        _record(errors, f"{prefix}output", torch.cat(outputs), ref_out.detach())
        _record(errors, f"{prefix}input grad", torch.cat(input_grads), ref_x.grad)
        _record_layer(errors, prefix, layer, reference, _own)  # the copies' gradients have added up
    return errors


def tolerance(case: Case, world_size: int = 2, device: str = "cpu") -> float:
    """Largest relative error accepted for ``case`` on ``device``.

    A mean far from zero gets no extra slack when synchronized on the CPU, which normalizes a shifted copy
    of the input. A single rank has nobody to sync with and runs plain ``nn.BatchNorm``, and the CUDA
    path, like native CUDA BatchNorm, normalizes with a float32 mean (``batch_norm_elemt`` takes the
    accumulate type): both lose ``offset * 2^-24`` of float32 and half inputs' accuracy there (about
    6e-4 at ``offset=1e4``), which is PyTorch's own accuracy on that device.
    """
    float32_mean = device != "cpu" and case.dtype != torch.float64
    if (world_size == 1 or float32_mean) and case.offset:
        return max(_TOLERANCE[case.dtype], case.offset * 2.0**-24 * 10)
    return _TOLERANCE[case.dtype]


def _check_cases(rank: int, world_size: int, cases: list[Case], device: str) -> list[dict[str, float]]:
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    with warnings.catch_warnings():  # the cases call bare layers on purpose: no data-parallel wrapper
        warnings.filterwarnings("ignore", "distsync: the synchronized layer", RuntimeWarning)
        return [run_case(case, rank, device=device) for case in cases]


def cuda_backend(world_size: int) -> str:
    """NCCL when it can give every rank its own GPU (as training does), else gloo (which takes CUDA
    tensors and lets ranks share a GPU)."""
    usable = dist.is_nccl_available() and world_size <= torch.cuda.device_count()
    return "nccl" if usable else "gloo"


def default_cases(world_size: int) -> list[Case]:
    """A tour of the layer's features for ``world_size`` ranks."""
    even = tuple([4] * world_size)
    uneven = tuple(range(1, world_size + 1))
    with_empty = (0, *tuple(range(2, world_size + 1)))
    return [
        Case(even, shape=(5,)),
        Case(uneven, shape=(4, 7)),
        Case(with_empty, shape=(3, 4, 5)),
        Case(uneven, shape=(3, 2, 3, 4)),
        Case(even, shape=(8, 4, 4), channels_last=True),
        Case(uneven, shape=(4, 3, 3), dtype=torch.float16),
        Case(uneven, shape=(4, 3, 3), dtype=torch.bfloat16),
        Case(uneven, shape=(4, 3, 3), dtype=torch.float16, param_dtype=torch.float16),  # model.half()
        Case(uneven, shape=(4, 3, 3), dtype=torch.float64, momentum=None),
        Case(uneven, momentum=None, affine=False),
        Case(uneven, track_running_stats=False, generic_class=True),
        Case(even, shape=(4, 8, 8), offset=1e4),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distsync.check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nproc", type=int, default=2, help="worker processes, or copies with --shim (default 2)"
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the synced layer runs (default cpu)"
    )
    parser.add_argument(
        "--shim",
        action="store_true",
        help="check the nn.DataParallel shim instead: --nproc copies of the layer in threads of this "
        "process, on the CPU, as DataParallel runs them on that many GPUs",
    )
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    cases = default_cases(args.nproc)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.shim and args.device != "cpu":
        parser.error("--shim runs on the CPU; on GPUs, run your DataParallel model itself")
    backend = cuda_backend(args.nproc) if args.device == "cuda" else "gloo"
    where = f"{args.nproc} {backend} ranks, {args.device}"
    if args.shim:
        where = f"{args.nproc} DataParallel copies in threads of one CPU process (the shim)"
    print(f"distsync self-check: {len(cases)} cases on {where} (torch {torch.__version__})")
    try:
        if args.shim:
            per_rank = [[run_shim_case(case, seed=0) for case in cases]]
        else:
            per_rank = run_world(_check_cases, args.nproc, cases, args.device, backend=backend)
    except WorkerFailed as failure:
        print(failure, file=sys.stderr)
        return 1
    failed = 0
    for index, case in enumerate(cases):
        worst = {key: max(rank_errors[index][key] for rank_errors in per_rank) for key in per_rank[0][index]}
        error = max(worst.values())
        limit = tolerance(case, args.nproc, args.device)
        failed += error > limit
        verdict = "PASS" if error <= limit else "FAIL"
        print(f"{verdict}  max rel. error {error:.1e} (tol {limit:.0e})  {case.describe()}")
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
