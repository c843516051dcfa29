"""The CUDA path: synced BN on GPU equals float64 BatchNorm on the global batch (skipped without CUDA).

Ranks talk over gloo, which takes CUDA tensors, so two ranks may share one GPU.
"""

import pytest
import torch

import distsync
from distsync.check import _check_cases, default_cases, tolerance
from distsync.testing import run_world

pytestmark = pytest.mark.cuda


def test_cuda_matches_batchnorm_on_global_batch():
    cases = default_cases(2)
    per_rank = run_world(_check_cases, 2, cases, "cuda")
    for index, case in enumerate(cases):
        for errors in per_rank:
            worst = max(errors[index].values())
            assert worst <= tolerance(case, 2, "cuda"), (case.describe(), errors[index])


def test_cuda_single_process_is_plain_batchnorm():
    reference = torch.nn.BatchNorm2d(5).cuda()
    layer = distsync.DistSyncBatchNorm2d(5).cuda()
    x = torch.randn(4, 5, 3, 3, device="cuda")
    assert torch.equal(layer(x), reference(x))


def _captured_steps(rank, world_size):
    """Warm up on a side stream, capture a forward + backward in a CUDA graph, replay it 3 times."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), distsync.DistSyncBatchNorm2d(4)).to(device)
    x = torch.randn(4, 3, 8, 8, device=device) + rank
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x).sum().backward()
    torch.cuda.current_stream(device).wait_stream(side)
    distsync.check_sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(x).sum().backward()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    distsync.check_sync()  # reads the captured calls' verdicts as of the last replay
    return model[1].running_mean.cpu(), int(model[1].num_batches_tracked)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for an NCCL world")
def test_cuda_graph_capture_and_replay():
    (mean0, batches0), (mean1, batches1) = run_world(_captured_steps, 2, backend="nccl")
    assert batches0 == batches1 == 6  # 3 eager steps and 3 replays; the capture itself runs nothing
    assert torch.equal(mean0, mean1)
