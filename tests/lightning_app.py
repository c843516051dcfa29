"""A Lightning DDP fit on CPU with distsync's plugin (run by tests/test_lightning.py).

Usage: ``lightning_app.py OUT_DIR PACKAGE DEVICES GROUP_SIZE``, PACKAGE ``lightning.pytorch`` or
``pytorch_lightning``. Lightning's DDP launcher re-runs this script for the other ranks. Each rank fits
three steps of 2 samples with ``momentum=None`` (running statistics are the average of the steps') and writes
``rank<R>.json``: the batches it saw, its running statistics and the layer type seen during and after fit.
"""

import importlib
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distsync.lightning import DistSyncBatchNormPlugin

STEPS, PER_RANK = 3, 2


def fit(out_dir: Path, package: str, devices: int, group_size: int) -> None:
    pl = importlib.import_module(package)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3, momentum=None)
            self.seen, self.batches = None, []

        def training_step(self, batch, index):
            self.seen = type(self.bn).__name__
            self.batches.append(batch[0].tolist())
            return self.bn(batch[0]).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    data = torch.randn(STEPS * PER_RANK * devices, 3, generator=torch.Generator().manual_seed(0)) * 3 + 1
    model = Model()
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=devices,
        sync_batchnorm=True,
        plugins=[DistSyncBatchNormPlugin(group_size=group_size)],
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=PER_RANK))
    result = {
        "layer_during_fit": model.seen,
        "layer_after_fit": type(model.bn).__name__,
        "batches": model.batches,
        "running_mean": model.bn.running_mean.tolist(),
        "running_var": model.bn.running_var.tolist(),
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    fit(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    # Lightning leaves the process group (and the BN subgroups) to interpreter exit, where gloo's teardown
    # can abort a rank that exits while another still holds the group, or deadlock when DDP frees it last:
    # once the DDP model is gone (fit returned), wait, then destroy the groups.
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
