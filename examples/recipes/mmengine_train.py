"""mmengine's Runner with synchronized batch norm: convert the model before the Runner wraps it, and leave
the Runner's own ``sync_bn`` unset (``sync_bn='torch'`` would replace distsync's layers by
``nn.SyncBatchNorm``, which refuses CPU tensors).

    torchrun --nproc_per_node=2 examples/recipes/mmengine_train.py

The Runner wraps the model in ``MMDistributedDataParallel`` (a DDP), which averages the gradients. Its own
process-group setup (``launcher='pytorch'``) needs a GPU per rank, so ``distsync.init_distributed()`` makes
the group first (gloo on CPUs, nccl and this rank's GPU otherwise); the Runner then uses it. On CPUs the
wrapper must get ``device_ids=None``; ``no_buffer_broadcast()`` turns DDP's buffer broadcast off, which
synchronized layers do not need (their running statistics are equal on every rank by themselves).
"""

import json
import os
import tempfile

import torch
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch import nn
from torch.utils.data import TensorDataset

import distsync


class Classifier(BaseModel):
    def __init__(self) -> None:
        super().__init__(init_cfg=[dict(type="Constant", layer=["_BatchNorm"], val=1.0, bias=0.0)])
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 4)

    def forward(self, inputs, labels, mode="tensor"):
        logits = self.head(self.body(inputs).flatten(1))
        if mode == "loss":
            return {"loss": nn.functional.cross_entropy(logits, labels)}
        return logits


def collate(batch):
    inputs, labels = zip(*batch, strict=True)
    return {"inputs": torch.stack(inputs), "labels": torch.stack(labels)}


def main() -> None:
    device = distsync.init_distributed()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,)))
    runner = Runner(
        model=distsync.convert_sync_batchnorm(Classifier()),
        work_dir=os.environ.get("RECIPE_WORK_DIR") or tempfile.mkdtemp(),
        train_dataloader=dict(
            dataset=data, batch_size=4, sampler=dict(type="DefaultSampler", shuffle=True), collate_fn=collate
        ),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        train_cfg=dict(by_epoch=False, max_iters=4),
        launcher="pytorch",
        default_hooks=dict(checkpoint=None, logger=dict(type="LoggerHook", interval=1)),
        # the Runner reads its model wrapper from ``cfg`` (a config file's ``model_wrapper_cfg``)
        cfg=dict(
            model_wrapper_cfg=dict(
                type="MMDistributedDataParallel",
                device_ids=None if device.type == "cpu" else [device.index],
                **distsync.no_buffer_broadcast(),
            )
        ),
    )
    runner.train()
    layer = runner.model.module.body[1]
    out = os.environ.get("RECIPE_REPORT")
    if out:
        with open(f"{out}.{runner.rank}", "w") as file:
            json.dump({"weight": layer.weight.tolist(), "running_mean": layer.running_mean.tolist()}, file)


if __name__ == "__main__":
    main()
