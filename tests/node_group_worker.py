"""A torchrun worker for the node-group tests: syncs within its node through a node group and a DeviceMesh,
or (``ddp``) trains under DDP's defaults with a node group, nodes of unequal sizes allowed."""

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import distsync


def batch(rank: int, step: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank + 10 * step)
    return torch.randn(2 + rank, 3, generator=generator, dtype=torch.float64) + rank


def main(out_dir: str) -> None:
    distsync.init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    node_group = distsync.create_syncbn_process_group("node")
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("node", "local"))
    result = {"node_ranks": dist.get_process_group_ranks(node_group)}
    for name, group in (("node group", node_group), ("mesh dim", (mesh, "local"))):
        layer = distsync.DistSyncBatchNorm1d(3, dtype=torch.float64, process_group=group)
        layer(batch(rank))
        result[name] = layer.running_mean.tolist()
    with open(f"{out_dir}/rank{rank}.json", "w") as file:
        json.dump(result, file)
    dist.destroy_process_group()


def ddp_main(out_dir: str, steps: int) -> None:
    """Steps of ``DDP(layer)`` with DDP's defaults (buffers broadcast before each forward), the layer syncing
    within this rank's node; a hang fails after 20 s instead of the default timeout."""
    distsync.init_distributed(timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    node_group = distsync.create_syncbn_process_group("node")
    layer = distsync.DistSyncBatchNorm1d(3, dtype=torch.float64, process_group=node_group)
    ddp = torch.nn.parallel.DistributedDataParallel(layer)
    result = {"node_ranks": dist.get_process_group_ranks(node_group), "outputs": [], "input grads": []}
    for step in range(steps):
        x = batch(rank, step).requires_grad_()
        out = ddp(x)
        out.backward(x.detach() ** 2)
        result["outputs"].append(out.tolist())
        result["input grads"].append(x.grad.tolist())
    result.update({name: buffer.tolist() for name, buffer in layer.named_buffers()})
    with open(f"{out_dir}/rank{rank}.json", "w") as file:
        json.dump(result, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2:3] == ["ddp"]:
        ddp_main(sys.argv[1], int(sys.argv[3]))
    else:
        main(sys.argv[1])
