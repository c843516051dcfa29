"""A DDP training step with DistSyncBatchNorm equals single-process training on the full batch."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import distsync
from distsync.testing import free_port, run_world

PER_RANK = 4


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1),
        nn.BatchNorm2d(6, momentum=None),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    ).double()


def _batches(world_size, steps):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(world_size * PER_RANK, 3, 6, 6, generator=gen, dtype=torch.float64) * 2 + 1
        yield x, torch.randint(0, 3, (world_size * PER_RANK,), generator=gen)


def _train(model, batches, rank=0, per_rank=None, accumulate=1):
    """Train on ``batches`` (this rank's share of each, with ``per_rank``), one optimizer step per
    ``accumulate`` of them; a DDP model averages gradients at the last one only (``no_sync()`` before)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        if per_rank is not None:
            x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        if i % accumulate == 0:
            optimizer.zero_grad()
        last = i % accumulate == accumulate - 1
        with contextlib.nullcontext() if last or per_rank is None else model.no_sync():
            (nn.functional.cross_entropy(model(x), y) / accumulate).backward()
        if last:
            optimizer.step()
    module = getattr(model, "module", model)
    return {k: v.clone() for k, v in module.state_dict().items()}


def _ddp_worker(rank, world_size, steps):
    model = DistributedDataParallel(distsync.convert_sync_batchnorm(_net()), **distsync.no_buffer_broadcast())
    return _train(model, _batches(world_size, steps), rank, PER_RANK)


def test_ddp_step_equals_single_process_full_batch():
    steps = 3
    expected = _train(_net(), _batches(2, steps))
    for state in run_world(_ddp_worker, 2, steps):
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-10, msg=key)


class _CheckpointedTail(nn.Sequential):
    """``_net()``'s layers, those after the first ReLU under reentrant activation checkpointing."""

    def forward(self, x):
        layers = list(self)  # (a slice of a Sequential subclass is one of this class)
        for layer in layers[:3]:
            x = layer(x)
        return checkpoint(nn.Sequential(*layers[3:]), x, use_reentrant=True)


# DDP settings that users pick, each a model of its own in one world: DDP's keyword arguments (its default
# buffer broadcast included), batches accumulated per optimizer step, and how the model is wrapped
_DDP_SETTINGS = {
    "static_graph": ({"static_graph": True}, 1, "DDP"),
    "find_unused_parameters": ({"find_unused_parameters": True}, 1, "DDP"),
    "no_sync() accumulation, gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, 3, "DDP"),
    "reentrant checkpointing, static_graph": ({"static_graph": True}, 1, "checkpointed"),
    "torch.compile(ddp_model)": ({}, 1, "compile(DDP)"),
    "DDP(torch.compile(model))": ({}, 1, "DDP(compile)"),
}


def _ddp_settings_worker(rank, world_size, steps):
    states = {}
    for name, (settings, accumulate, wrapping) in _DDP_SETTINGS.items():
        model = distsync.convert_sync_batchnorm(_net())
        if wrapping == "checkpointed":
            model = _CheckpointedTail(*model)
        inner = torch.compile(model, backend="aot_eager") if wrapping == "DDP(compile)" else model
        ddp = DistributedDataParallel(inner, **settings)
        trained = torch.compile(ddp, backend="aot_eager") if wrapping == "compile(DDP)" else ddp
        _train(trained, _batches(world_size, steps * accumulate), rank, PER_RANK, accumulate)
        states[name] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


def test_ddp_settings_users_pick_keep_the_full_batch_result():
    """Under DDP's static graph, unused-parameter search, gradient accumulation with ``no_sync()``,
    reentrant checkpointing (which DDP needs a static graph for) and ``torch.compile`` outside or inside the
    DDP model, training equals single-process eager training on the full batches, accumulated alike,
    without checkpointing: the statistics move once per call."""
    steps = 2
    ranks = run_world(_ddp_settings_worker, 2, steps)
    for name, (_, accumulate, _) in _DDP_SETTINGS.items():
        expected = _train(_net(), _batches(2, steps * accumulate), accumulate=accumulate)
        for state in (states[name] for states in ranks):
            for key, value in expected.items():
                torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-10, msg=f"{name}: {key}")


def test_init_distributed_under_torchrun_environment():
    """init_distributed reads torchrun's variables, picks gloo on CPU, and is a no-op the second time."""
    script = (
        "import torch.distributed as dist, distsync\n"
        "device = distsync.init_distributed()\n"
        "assert distsync.init_distributed() == device\n"
        "print(device, dist.get_backend(), dist.get_world_size())\n"
        "dist.destroy_process_group()\n"
    )
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        CUDA_VISIBLE_DEVICES="",
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the script's line comes last: gloo of some torch releases (2.8.0) prints "[Gloo] Rank 0 ..." first
    assert out.stdout.splitlines()[-1].split() == ["cpu", "gloo", "1"], out.stdout


def test_init_distributed_without_torchrun_is_single_process():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    script = (
        "import torch.distributed as dist, distsync\n"
        "distsync.init_distributed()\n"
        "print(dist.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _load_on_rank_0_after_wrapping(rank, world_size, broadcast):
    torch.manual_seed(0)
    model = distsync.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(2, 3)).sum().backward()  # it has trained under DDP
    saved = {"1.running_mean": torch.arange(4.0), "1.running_var": torch.full((4,), 3.0)}
    if rank == 0:  # then a checkpoint only rank 0 reads
        ddp.module.load_state_dict(saved, strict=False)
    if broadcast:  # docs/migration.md's line
        for buffer in ddp.module.buffers():
            dist.broadcast(buffer, src=0)
    ddp(torch.randn(2 + rank, 3)).sum().backward()  # a synchronized training step
    return ddp.module[1].running_mean.tolist()


@pytest.mark.parametrize("broadcast", [False, True], ids=["as-is", "broadcast"])
def test_statistics_loaded_on_rank_0_after_wrapping_reach_every_rank_only_through_a_broadcast(broadcast):
    """A synchronized model's running statistics leave DDP's per-forward broadcast at their first call, so
    a checkpoint loaded on rank 0 alone once the model has trained stays there unless the documented
    broadcast (or a load on every rank) hands it over."""
    first, second = run_world(_load_on_rank_0_after_wrapping, 2, broadcast)
    assert (first == second) is broadcast
