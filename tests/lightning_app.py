"""A 2-process Lightning DDP fit on CPU with distsync's plugin (run by tests/test_lightning.py).

Lightning's DDP launcher re-runs this script for rank 1. Each rank sees half of 8 samples; one step with
momentum 1 leaves the synchronized batch's statistics in the running buffers, which rank 0 writes as JSON.
Usage: ``lightning_app.py OUT.json [GROUP_SIZE]``; with group size 1 each rank keeps its own statistics.
"""

import json
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distsync.lightning import DistSyncBatchNormPlugin

DATA = torch.randn(8, 3, generator=torch.Generator().manual_seed(0)) * 3 + 1


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3, momentum=1.0)
        self.seen = self.batch = None

    def training_step(self, batch, index):
        self.seen, self.batch = type(self.bn).__name__, batch[0]
        return self.bn(batch[0]).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(group_size: int) -> tuple[int, dict]:
    """Fit on this rank; return the global rank and what rank 0 reports."""
    model = Model()
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        sync_batchnorm=True,
        plugins=[DistSyncBatchNormPlugin(group_size=group_size)],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(DATA), batch_size=4))
    return trainer.global_rank, {
        "layer_during_fit": model.seen,
        "layer_after_fit": type(model.bn).__name__,
        "running_mean": model.bn.running_mean.tolist(),
        "running_var": model.bn.running_var.tolist(),
        # Synchronized: all 8 samples; in groups of 1: the 4 that rank 0 saw.
        "expected_mean": (model.batch if group_size == 1 else DATA).mean(0).tolist(),
        "expected_var": (model.batch if group_size == 1 else DATA).var(0).tolist(),
    }


if __name__ == "__main__":
    rank, result = fit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    if rank == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(result, out)
    # Lightning leaves the process group (and the BN subgroups) to interpreter exit, where gloo's teardown
    # can abort a rank that exits while another still holds the group, or deadlock when DDP frees it last:
    # once the DDP model is gone (fit returned), wait, then destroy the groups.
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
