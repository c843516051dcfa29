"""Synced BN within groups of k ranks equals float64 BatchNorm on each group's concatenated batch."""

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from launching import job_env
from node_group_worker import batch
from torch import nn

import distsync
from distsync.testing import free_port, run_world

SIZES = (2, 3, 1, 4)  # per-rank batch sizes of a 4-rank world, groups {0, 1} and {2, 3}


def _grouped(rank, world_size, group_size):
    group = distsync.create_syncbn_process_group(group_size)
    full = torch.randn(sum(SIZES), 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dy = torch.randn(full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    members = range(rank - rank % group_size, rank - rank % group_size + group_size)
    start = sum(SIZES[: members[0]])
    group_rows = slice(start, start + sum(SIZES[r] for r in members))
    mine = slice(sum(SIZES[:rank]) - start, sum(SIZES[: rank + 1]) - start)
    reference = nn.BatchNorm1d(3).double()
    ref_x = full[group_rows].clone().requires_grad_()
    reference(ref_x).backward(dy[group_rows])
    layer = distsync.DistSyncBatchNorm1d(3, process_group=group, dtype=torch.float64)
    x = full[group_rows][mine].clone().requires_grad_()
    out = layer(x)
    out.backward(dy[group_rows][mine])
    expected = reference.eval()(full[group_rows][mine])  # the group's running stats, checked through eval
    layer.eval()
    return {
        "eval output": (layer(x.detach()) - expected).abs().max().item(),
        "input grad": (x.grad - ref_x.grad[mine]).abs().max().item(),
        "running_mean": layer.running_mean.tolist(),
    }


def test_groups_of_two_sync_within_their_group_only():
    per_rank = run_world(_grouped, 4, 2)
    for result in per_rank:
        assert result["eval output"] < 1e-10 and result["input grad"] < 1e-10, result
    assert per_rank[0]["running_mean"] == per_rank[1]["running_mean"]
    assert per_rank[2]["running_mean"] == per_rank[3]["running_mean"]
    assert per_rank[0]["running_mean"] != per_rank[2]["running_mean"]


def _whole_world_and_error(rank, world_size):
    whole = distsync.create_syncbn_process_group(world_size)
    try:
        distsync.create_syncbn_process_group(3)
    except ValueError as error:
        return whole, str(error)
    return whole, None


def test_whole_world_and_bad_sizes_on_every_rank():
    for whole, message in run_world(_whole_world_and_error, 2):
        assert whole is None
        assert message == "group_size=3 must be a positive divisor of the world size 2"


def _disagreeing_sizes(rank, world_size):
    try:
        distsync.create_syncbn_process_group(2 if rank == 0 else 4)
    except ValueError as error:
        return str(error)
    return None


def test_ranks_that_disagree_on_the_group_size_all_raise():
    for message in run_world(_disagreeing_sizes, 4):
        assert message is not None and "disagree on group_size (from 2 to 4)" in message


def _zero_or_world(rank, world_size):
    group = distsync.create_syncbn_process_group(0 if rank == 0 else world_size)
    layer = distsync.DistSyncBatchNorm1d(2, process_group=group, dtype=torch.float64)
    layer(torch.full((1, 2), float(rank), dtype=torch.float64))  # one value per rank: needs the whole world
    return group, layer.running_mean.tolist()


def test_zero_and_the_world_size_are_the_same_group_size():
    (group0, mean0), (group1, mean1) = run_world(_zero_or_world, 2)
    assert group0 is None and group1 is None
    assert mean0 == mean1 == [0.05, 0.05]  # momentum 0.1 times the global mean 0.5


def _run_nodes(tmp_path, ranks_per_node, *worker_args):
    """Run node_group_worker.py under one torchrun agent per node on this machine; each rank's result."""
    script = Path(__file__).with_name("node_group_worker.py")
    endpoint = f"localhost:{free_port()}"
    rdzv_id = f"nodes-{uuid.uuid4().hex[:8]}"
    env = job_env(PYTHONPATH=str(Path(distsync.__file__).parents[1]))  # the distsync under test
    agents = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(ranks_per_node)}",
                f"--nproc_per_node={count}", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                f"--rdzv_id={rdzv_id}", str(script), str(tmp_path), *worker_args,
            ],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for count in ranks_per_node
    ]  # fmt: skip
    outputs = [agent.communicate(timeout=240)[0].decode() for agent in agents]
    assert [agent.returncode for agent in agents] == [0] * len(agents), outputs
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(sum(ranks_per_node))]


@pytest.mark.slow
def test_node_groups_and_mesh_dimensions_sync_within_each_node(tmp_path):
    """Two torchrun agents on this machine, 2 ranks each: "node" groups and a DeviceMesh dimension give
    each node the statistics of its own ranks' batches."""
    for rank, result in enumerate(_run_nodes(tmp_path, (2, 2))):
        node = [0, 1] if rank < 2 else [2, 3]
        assert result["node_ranks"] == node
        expected = torch.cat([batch(r) for r in node]).mean(0)
        torch.testing.assert_close(torch.tensor(result["node group"], dtype=torch.float64), 0.1 * expected)
        assert result["mesh dim"] == result["node group"]


@pytest.mark.slow
def test_nodes_of_two_and_one_workers_train_under_default_ddp(tmp_path):
    """Nodes of 2 and 1 workers, DDP's defaults: the worker alone on its node leaves its layer's statistics
    out of DDP's buffer broadcast as the others do (else DDP's buffer lists differ and every rank hangs);
    each node's outputs, input gradients and running statistics are float64 BatchNorm's on its batches."""
    steps = 3
    results = _run_nodes(tmp_path, (2, 1), "ddp", str(steps))
    nodes = sorted({tuple(result["node_ranks"]) for result in results})  # which agent is first varies
    assert sorted(map(len, nodes)) == [1, 2], nodes
    exact = {"rtol": 0.0, "atol": 1e-10}

    def tensor(values, like):
        return torch.tensor(values, dtype=like.dtype)

    for node in nodes:
        reference = nn.BatchNorm1d(3, dtype=torch.float64)
        for step in range(steps):
            x = torch.cat([batch(r, step) for r in node]).requires_grad_()
            out = reference(x)
            out.backward(x.detach() ** 2)
            start = 0
            for rank in node:
                mine = slice(start, start + len(batch(rank)))
                start = mine.stop
                result = results[rank]
                torch.testing.assert_close(tensor(result["outputs"][step], out), out[mine], **exact)
                torch.testing.assert_close(tensor(result["input grads"][step], out), x.grad[mine], **exact)
        for rank in node:
            for name, buffer in reference.named_buffers():
                torch.testing.assert_close(tensor(results[rank][name], buffer), buffer, **exact, msg=name)


def test_a_mesh_of_several_dimensions_needs_a_dimension():
    class FakeMesh:  # DeviceMesh's interface: ndim, mesh_dim_names, get_group
        ndim, mesh_dim_names = 2, ("dp", "tp")

        def get_group(self, dim=None):
            return f"group of {dim}"

    with pytest.raises(ValueError, match=r"Pass \(mesh, dim\), with dim one of \['dp', 'tp'\]"):
        distsync.DistSyncBatchNorm2d(3, process_group=FakeMesh())
    assert distsync.DistSyncBatchNorm2d(3, process_group=(FakeMesh(), "dp")).process_group == "group of dp"
