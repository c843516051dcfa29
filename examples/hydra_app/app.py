"""A Hydra app of your own whose every run is a torchrun world: copy this folder and make it yours.

    python app.py                                     # one run: a 2-rank world
    python app.py -m lr=0.05,0.2                      # a sweep: one world per job, one job after the other
    python app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 lr=0.05,0.2  # by the plugin
    python app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=1 hydra.launcher.n_jobs=2 \
        lr=0.05,0.1,0.2,0.4                           # two jobs at a time, each on its own cores (or GPUs)
    python app.py -m hydra/sweeper=distsync_optuna hydra.sweeper.direction=maximize \
        hydra.sweeper.n_trials=20 'lr=tag(log,interval(0.01,1))' hydra/launcher=torchrun \
        hydra.launcher.n_jobs=2 hydra/sweeper/pruner=median
                                                      # Optuna maximizes what rank 0 returns; losers pruned

Each rank trains a small MLP with synchronized batch norm on its shard of a synthetic data set, under DDP.
Every ``eval_every`` steps it measures the held-out accuracy, reports it to an Optuna sweep's study and
stops if the study's pruner says so (outside such a sweep both calls do nothing).
"""

from __future__ import annotations

import json
import logging
import os

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn

import distsync

log = logging.getLogger("hydra_app")


def make_data(cfg: DictConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs around one random centre per class; the same on every rank (fixed seed)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    centres = torch.randn(cfg.data.num_classes, cfg.data.features, generator=generator) * 3
    labels = torch.randint(cfg.data.num_classes, (cfg.data.samples,), generator=generator)
    noise = torch.randn(cfg.data.samples, cfg.data.features, generator=generator) * cfg.data.noise
    return centres[labels] + noise, labels


def make_model(cfg: DictConfig) -> nn.Module:
    return nn.Sequential(
        nn.Linear(cfg.data.features, cfg.model.hidden),
        nn.BatchNorm1d(cfg.model.hidden),
        nn.ReLU(),
        nn.Linear(cfg.model.hidden, cfg.data.num_classes),
    )


def train(cfg: DictConfig) -> float:
    """One rank's training; returns the held-out accuracy (the same on every rank)."""
    device = distsync.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    log.info(f"rank {rank} of a {world}-rank world on {device}")  # hydra/launcher=torchrun sets its size
    _record(cfg, HydraConfig.get().runtime.output_dir, rank)
    if rank == cfg.fail_on_rank:
        raise RuntimeError(f"rank {rank} fails on purpose (fail_on_rank={cfg.fail_on_rank})")
    accuracy = fit(cfg, device, rank, world)
    # The DDP model, which holds the process group, is gone now: the group goes last (a gloo group freed
    # by DDP after destroy_process_group can deadlock in its destructor).
    dist.barrier()  # nobody leaves while another rank still needs the group
    dist.destroy_process_group()
    return accuracy


def fit(cfg: DictConfig, device: torch.device, rank: int, world: int) -> float:
    """Train the model on this rank's shard under DDP; return its held-out accuracy."""
    inputs, labels = make_data(cfg)
    split = len(labels) * 3 // 4
    train_x, train_y = inputs[:split][rank::world], labels[:split][rank::world]
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = distsync.convert_sync_batchnorm(make_model(cfg)).to(device)
    # The synchronized layers keep their running statistics equal on every rank: DDP need not broadcast
    # the buffers before every forward.
    model = nn.parallel.DistributedDataParallel(model, **distsync.no_buffer_broadcast())
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(cfg.seed + rank)
    held_out = inputs[split:].to(device), labels[split:].to(device)
    accuracy = float("nan")
    for step in range(1, cfg.steps + 1):
        batch = torch.randint(len(train_y), (cfg.batch_size,), generator=generator)
        loss = nn.functional.cross_entropy(model(train_x[batch].to(device)), train_y[batch].to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        distsync.check_sync()  # once per step: raises on every rank what a GPU found wrong (no-op on CPU)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            accuracy = evaluate(model, *held_out)
            log.info(f"step {step}: loss {loss.item():.4f}, held-out accuracy {accuracy:.3f}")
            distsync.report(step, accuracy)  # to an Optuna sweep's study (from rank 0); else nothing
            if distsync.should_prune():  # the same answer on every rank: all stop at this step
                log.info(f"pruned at step {step}")
                break
    return accuracy


def evaluate(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """The accuracy on the held-out samples (the same on every rank: the same samples and weights)."""
    model.eval()
    with torch.no_grad():
        accuracy = (model(inputs).argmax(1) == labels).float().mean().item()
    model.train()
    return accuracy


def _record(cfg: DictConfig, run_dir: str, rank: int) -> None:
    """What this rank was given, for a look (and for the tests): its config and its Hydra job."""
    hydra_cfg = HydraConfig.get()
    record = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "output_dir": hydra_cfg.runtime.output_dir,
        "job_num": hydra_cfg.job.get("num"),
        "world_size": dist.get_world_size(),
        "pid": os.getpid(),
        "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as file:
        json.dump(record, file)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    # One line makes the run a torchrun world. Under torchrun, or as a job of hydra/launcher=torchrun,
    # this process already is a rank, and launch() runs train() right here.
    return distsync.launch(train, cfg, nproc_per_node=cfg.nproc_per_node)


if __name__ == "__main__":
    main()
