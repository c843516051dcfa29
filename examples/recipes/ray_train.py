"""Ray Train with synchronized batch norm: Ray starts the workers and their process group (gloo on CPUs,
nccl on GPUs), ``prepare_model`` wraps the model in DDP, distsync synchronizes the batch norms.

    pip install "ray[train]"
    python examples/recipes/ray_train.py            # 2 CPU workers on a local Ray cluster
    python examples/recipes/ray_train.py --gpus     # one GPU per worker

Convert before ``prepare_model``, so that the DDP model Ray builds holds the synchronized layers. Passing
``distsync.no_buffer_broadcast()`` to DDP is optional: the synchronized layers' running statistics are equal
on every rank by themselves and are left out of DDP's buffer broadcast either way; it turns the broadcast
off for the model's other buffers too.
"""

import argparse
import json

import ray.train
import ray.train.torch
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

import distsync


def train_loop(config: dict) -> None:
    """Runs on every worker, in the world Ray made."""
    torch.manual_seed(0)  # the same initial model on every worker
    body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
    model = distsync.convert_sync_batchnorm(nn.Sequential(body, nn.Flatten(), nn.Linear(8, 4)))
    model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=distsync.no_buffer_broadcast())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    generator = torch.Generator().manual_seed(rank)
    for _ in range(config["steps"]):
        # each rank's own batch, of its own size: the statistics are those of the global batch
        images = torch.randn(4 + 2 * rank, 3, 16, 16, generator=generator).to(device)
        labels = torch.randint(0, 4, (4 + 2 * rank,), generator=generator).to(device)
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        distsync.check_sync()  # raises any sync error the GPU found (no-op on the CPU)
    norm = model.module[0][1]
    state = {"weight": norm.weight.tolist(), "running_mean": norm.running_mean.tolist()}
    if config.get("report"):
        with open(f"{config['report']}.{rank}", "w") as file:
            json.dump({"type": type(norm).__name__, **state}, file)
    ray.train.report({"loss": loss.item()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpus", action="store_true", help="one GPU per worker")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--storage", default=None, help="Ray Train's storage_path (default: ~/ray_results)")
    parser.add_argument("--report", default="", help="each rank writes its BN state to REPORT.<rank>")
    args = parser.parse_args()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"steps": args.steps, "report": args.report},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpus),
        run_config=RunConfig(storage_path=args.storage, name="distsync-ray"),
    )
    result = trainer.fit()
    print(f"trained; Ray Train's record of the run: {result.path}")


if __name__ == "__main__":
    main()
