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
