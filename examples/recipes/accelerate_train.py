"""Hugging Face accelerate with synchronized batch norm: the ranks come from torchrun (or ``accelerate
launch --multi_gpu``), ``Accelerator`` wraps the model in DDP, distsync synchronizes the batch norms.

    torchrun --nproc_per_node=2 examples/recipes/accelerate_train.py                # CPU processes (gloo)
    accelerate launch --multi_gpu --num_processes=2 examples/recipes/accelerate_train.py  # one GPU each

``accelerate launch --cpu --num_processes=2`` starts a single process, so on CPUs start the ranks with
torchrun and pass ``cpu=True``: the Accelerator then joins their world. ``distsync.init_distributed()``
makes that world first (nccl and this rank's GPU, or gloo on CPUs), which accelerate adopts, and keeps a
gloo group alive until the process ends, so the script ends cleanly. Convert before ``prepare``, so that
the DDP model accelerate builds holds the synchronized layers.
"""

import json
import os

import torch
from accelerate import Accelerator
from torch import nn

import distsync


def main() -> None:
    distsync.init_distributed()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
    model = distsync.convert_sync_batchnorm(nn.Sequential(body, nn.Flatten(), nn.Linear(8, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own batches
    for _ in range(3):
        x = torch.randn(4 + accelerator.process_index, 3, 8, 8, generator=generator).to(accelerator.device)
        y = torch.randint(0, 4, (x.shape[0],), generator=generator).to(accelerator.device)
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    layer = accelerator.unwrap_model(model)[0][1]
    report = {
        "world_size": accelerator.num_processes,
        "weight": layer.weight.tolist(),  # equal on every rank: gradients averaged by accelerate's DDP
        "running_mean": layer.running_mean.tolist(),  # equal on every rank: statistics synchronized
    }
    out = os.environ.get("RECIPE_REPORT")
    if out:
        with open(f"{out}.{accelerator.process_index}", "w") as file:
            json.dump(report, file)
    accelerator.print(f"trained on {accelerator.num_processes} ranks ({accelerator.distributed_type})")


if __name__ == "__main__":
    main()
