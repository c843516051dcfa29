"""Held-out metrics (each rank on its share, summed over every rank), and the check that BN buffers agree."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F

from distsync.train.build import batch_norms
from distsync.train.collectives import all_reduce
from distsync.train.data import eval_batches

__all__ = ["evaluate", "bn_buffers_in_sync"]

EVAL_BATCH_SIZE = 1024


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    test,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    num_workers: int,
    prepare: Callable[[torch.Tensor], torch.Tensor],
    autocast: Callable[[], AbstractContextManager],
) -> dict[str, float]:
    """``accuracy`` (top-1), ``eval_loss`` and, with more than 5 classes, ``accuracy_top5`` over ``test``.

    ``prepare`` lays out a batch of inputs on ``device`` as the model expects them. The model is evaluated
    in eval mode and left in training mode.
    """
    # loss sum, top-1 correct, count, top-5 correct
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    classes = 0
    model.eval()
    for x, y in eval_batches(test, rank, world_size, EVAL_BATCH_SIZE, num_workers):
        x, y = prepare(x.to(device)), y.to(device)
        with autocast():
            logits = model(x).float()
        classes = logits.shape[1]
        totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum().double()
        totals[2] += len(y)
        if classes > 5:
            totals[3] += (logits.topk(5, dim=1).indices == y[:, None]).any(1).sum().double()
    model.train()
    has_top5 = torch.tensor([float(classes > 5)], device=device)
    all_reduce(totals)
    all_reduce(has_top5)  # a rank with no held-out sample saw no logits
    count = max(totals[2].item(), 1.0)
    row = {"accuracy": totals[1].item() / count, "eval_loss": totals[0].item() / count}
    if has_top5.item() > 0:
        row["accuracy_top5"] = totals[3].item() / count
    return row


def bn_buffers_in_sync(model: torch.nn.Module, device: torch.device) -> bool:
    """True iff every BN buffer is bitwise identical on all ranks (an element-wise max == min check)."""
    buffers = [b.detach().double().flatten() for m in batch_norms(model) for b in m.buffers()]
    if not buffers:
        return True
    flat = torch.cat(buffers).to(device)
    high, low = flat.clone(), flat.clone()
    all_reduce(high, torch.distributed.ReduceOp.MAX)
    all_reduce(low, torch.distributed.ReduceOp.MIN)
    return bool(torch.equal(high, low))
