"""A torchrun worker for the node-group test: syncs within its node through a node group and a DeviceMesh."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import distsync


def batch(rank: int) -> torch.Tensor:
    return torch.randn(2 + rank, 3, generator=torch.Generator().manual_seed(rank), dtype=torch.float64) + rank


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


if __name__ == "__main__":
    main(sys.argv[1])
