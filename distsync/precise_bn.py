"""Precise BN: running statistics recomputed over whole data, merged exactly across ranks.

Running averages are a poor estimate of the population statistics a trained network sees (Wu & Johnson,
"Rethinking 'Batch' in BatchNorm", 2021): they mix statistics of weights long gone and weigh batches
unevenly. :func:`update_bn` recomputes them: the count, mean and sum of squared deviations of every
synchronized layer's inputs over every batch of every rank, merged without approximation (Chan et al.'s
pairwise formula, in float64), so the between-rank variance counts as the between-batch variance does.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from distsync import batchnorm
from distsync.batchnorm import DistSyncBatchNorm
from distsync.errors import SyncError

__all__ = ["update_bn"]


class _Moments(NamedTuple):
    """Per-channel count, mean and sum of squared deviations (float64 rows of one ``(3, C)`` tensor)."""

    rows: Tensor

    @staticmethod
    def of(input: Tensor) -> _Moments:
        dims = [0, *range(2, input.dim())]
        wide = input.detach().double()
        var, mean = torch.var_mean(wide, dims, correction=0)
        count = torch.full_like(mean, input.numel() // max(input.shape[1], 1))
        return _Moments(torch.stack([count, mean, var * count]))

    def merge(self, other: _Moments) -> _Moments:
        (n_a, mean_a, m2_a), (n_b, mean_b, m2_b) = self.rows, other.rows
        n = n_a + n_b
        share = torch.where(n > 0, n_b / n.clamp_min(1), 0.0)
        delta = mean_b - mean_a
        mean = mean_a + delta * share
        m2 = m2_a + m2_b + delta * delta * n_a * share
        return _Moments(torch.stack([n, mean, m2]))


@torch.no_grad()
def update_bn(
    loader: Iterable[Any],
    model: nn.Module,
    device: int | str | torch.device | None = None,
    num_batches: int | None = None,
) -> None:
    r"""Set the running statistics of every synchronized layer of ``model`` to those of all the data.

    Like ``torch.optim.swa_utils.update_bn``, but exact across ranks: every rank passes its own ``loader``
    (uneven lengths are fine) and every synchronized layer ends with the mean and unbiased variance of all
    its inputs over every batch of every rank of its process group, bit-identical on every rank. Call it
    on every rank. A layer whose input comes from other batch-norm layers sees that input as in training:
    each step's normalization by the statistics of that step's global batch (the paper's "train-mode
    features"). A rank whose loader ran out takes part in the others' steps with an empty batch, which
    changes no statistic: its last input (or, if it never had a batch, another rank's) in the same form
    (dict, list, dataclass, other values kept), every tensor in it sliced to no rows along its first
    dimension. Parameters, ``momentum``, ``num_batches_tracked``, every module's training flag and the
    buffers of batch-norm layers that are not synchronized are left as they were. A layer that saw no
    value keeps its statistics; one that saw a single value per channel keeps its variance.

    Args:
        loader: batches, each the model's input (a tensor, a dict, a dataclass, ...) or a list/tuple whose
            first element is the model's input (``(images, labels)``)
        model: the model (a DDP-wrapped model works too)
        device: where to move each batch. Default: ``None``, as it comes
        num_batches: use at most this many batches of this rank's loader. Default: ``None``, all

    Examples::

        >>> distsync.update_bn(train_loader, model, num_batches=200)  # before evaluating
    """
    if num_batches is not None and num_batches < 0:
        raise ValueError(f"update_bn: num_batches must be >= 0, got {num_batches}")
    layers = [m for m in model.modules() if isinstance(m, DistSyncBatchNorm) and m.track_running_stats]
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.running_mean is not None]
    saved = {m: [b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in norms}
    modes = {m: m.training for m in model.modules()}
    moments: dict[DistSyncBatchNorm, _Moments] = {}

    def observe(layer: DistSyncBatchNorm, input: Tensor, output: Tensor | None) -> None:
        if layer in saved and input.numel():
            batch = _Moments.of(input)
            moments[layer] = moments[layer].merge(batch) if layer in moments else batch

    batchnorm._call_observers.append(observe)
    model.train()
    try:
        _run(loader, model, device, num_batches)
    finally:
        batchnorm._call_observers.remove(observe)
        for module, training in modes.items():
            module.train(training)
        for module, values in saved.items():
            buffers = (module.running_mean, module.running_var, module.num_batches_tracked)
            for buffer, value in zip(buffers, values, strict=True):
                buffer.copy_(value)
    for layer in layers:
        _set_statistics(layer, moments.get(layer))


def _run(loader: Iterable[Any], model: nn.Module, device, num_batches: int | None) -> None:
    """Call ``model`` on each batch; in a world, step with the other ranks (empty batches once done)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    batches = iter(loader)
    last: Any = None
    step = 0
    while True:
        batch, failure = None, None
        try:
            if num_batches is None or step < num_batches:
                batch = next(batches, None)
            if batch is not None:
                last = _input_of(batch, device)
        except Exception as error:  # raised on every rank, not left to hang the others
            if not distributed:
                raise
            failure = error
        if distributed:
            input = _step_input(batch is not None, last, failure, device)
        else:
            input = last if batch is not None else None
        if input is None:
            return
        model(input)
        step += 1


def _step_input(has_batch: bool, last: Any, failure: Exception | None, device) -> Any:
    """This rank's input for a step of the world: its batch, an empty one of the same form if others still
    have batches, or None once every rank is done. Decided from reduced values, so every rank takes the
    same steps and a rank whose loader failed makes every rank raise."""
    nccl = dist.get_backend() == "nccl"
    here = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flags = torch.tensor([float(has_batch), float(last is None), float(failure is not None)], device=here)
    dist.all_reduce(flags)
    has_any, needs_template, failed = flags.tolist()
    if failure is not None:
        raise failure
    if failed:
        raise SyncError(f"update_bn: the loader of {int(failed)} other rank(s) failed; see their error")
    if not has_any:
        return None
    if needs_template:  # a rank has never had a batch: it takes the form of another rank's
        template = [None] * dist.get_world_size()
        dist.all_gather_object(
            template, None if last is None else _map_tensors(last, lambda t: _empty(t).cpu())
        )
        if last is None:
            form = next(t for t in template if t is not None)
            last = _map_tensors(form, lambda t: t.to(here if device is None else device))
    return last if has_batch else _map_tensors(last, _empty)


def _input_of(batch: Any, device) -> Any:
    """The model's input in a batch: its first element if it is a list or tuple, else the batch itself
    (a tensor, a dict, a dataclass, ...), with every tensor in it moved to ``device``."""
    input = batch[0] if isinstance(batch, (list, tuple)) else batch
    return input if device is None else _map_tensors(input, lambda t: t.to(device))


def _empty(tensor: Tensor) -> Tensor:
    """No samples of ``tensor`` (a batch along its first dimension; a scalar stays as it is)."""
    return tensor[:0] if tensor.dim() else tensor


def _map_tensors(value: Any, fn) -> Any:
    """``value`` with ``fn`` applied to every tensor in it: nested lists, tuples (named too), dicts (of any
    kind) and dataclasses keep their form; anything else is kept as it is."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, dict):
        mapped = copy.copy(value)  # the same kind of dict (an OrderedDict, a ModelOutput, ...)
        for key, item in value.items():
            mapped[key] = _map_tensors(item, fn)
        return mapped
    if isinstance(value, list):
        return [_map_tensors(item, fn) for item in value]
    if isinstance(value, tuple):
        items = [_map_tensors(item, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        mapped = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(mapped, field.name, _map_tensors(getattr(value, field.name), fn))
        return mapped
    return value


def _set_statistics(layer: DistSyncBatchNorm, local: _Moments | None) -> None:
    """Merge ``local`` over the layer's group in rank order (the same bits everywhere) and set its buffers."""
    c = layer.running_mean.numel()
    device = layer.running_mean.device
    rows = local.rows if local is not None else torch.zeros(3, c, dtype=torch.float64, device=device)
    group = layer.process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, rows.contiguous(), group=group)
        total = _Moments(gathered[0])
        for rows_of_rank in gathered[1:]:
            total = total.merge(_Moments(rows_of_rank))
    else:
        total = _Moments(rows)
    count, mean, m2 = total.rows
    seen, several = count > 0, count > 1
    layer.running_mean.copy_(torch.where(seen, mean, layer.running_mean.double()))
    unbiased = m2 / (count - 1).clamp_min(1)
    layer.running_var.copy_(torch.where(several, unbiased, layer.running_var.double()))
