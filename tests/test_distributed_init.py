"""init_distributed on GPU machines, with CUDA faked: it must not put two ranks on one GPU."""

import pytest
import torch

import distsync


def test_refuses_more_local_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but this node has 2 GPU"):
        distsync.init_distributed()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distsync.init_distributed() == torch.device("cuda", 1)  # no WORLD_SIZE: no group, the device
