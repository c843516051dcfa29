"""The synchronized forward as ops ``torch.compile`` traces whole (``fullgraph=True``).

The eager path runs an autograd ``Function`` around device kernels, Python-side call counters and a
host-side verdict; dynamo can trace none of that without a graph break. Under compile the same payload is
built from differentiable ops and summed with ``torch.distributed._functional_collectives.all_reduce``,
whose backward is the all-reduce of the payload's gradient: autograd derives the synchronized backward
(one all-reduce each way, as in eager mode). Everything that lives across calls is a device tensor
mutated in the graph: the call counter of the tail and the verdict flag.

Outside the traced code, at trace time, :func:`prepare` resolves the layer's identity (the same as in
eager mode: ``identity.resolve``) and the tail template; the tensors are the layer's ``Counters``, made
with it and moved with it. Verdicts are never read in the graph:
the first bad call's reduced tail is kept on the device and raised by :func:`distsync.check_sync`, which
every rank calls at the same point. A rank that rejects a call's input knows it while tracing (shapes
and dtypes are static there): :func:`refuse` makes its side of the call's all-reduce, its failure flagged,
before the traced code raises the problem; the peers' ``check_sync`` raises the failure where that call is
the first synchronized call of the graph (a rejected model input), else the earlier call it met out of
step. Limits: the backward all-reduce carries no identity tail (the forward one does), and compiled and
eager ranks do not sync with each other.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from distsync import _torch_compat
from distsync._syncbn import payload as _payload
from distsync._syncbn.payload import (
    CALL,
    COUNT,
    FORWARD,
    GUARD,
    LAYER_DIGITS,
    SQUARES,
    TAIL,
    CallTag,
    call_modulus,
    payload_size,
)
from distsync._syncbn.unwrapped import meet_callers

__all__ = ["TRACEABLE", "prepare", "refuse", "register", "sync_batch_norm"]

# Whether this torch's compiler traces the synchronized call whole (validated on 2.11 to 2.14; 2.4 and
# 2.6 fail on dynamic shapes, batch-norm subclasses' routing mode or the collective's gradient). Elsewhere a
# compiled model runs each synchronized call eagerly between graphs: the same results, and fullgraph=True
# refuses the model (tests/test_compile.py checks both).
TRACEABLE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)


class Counters:
    """A layer's tensors for compiled calls (mutated in place by the graph; integers, so that casting a
    model to another floating dtype leaves them alone; moved with the module)."""

    # A call's input was refused at trace time and dynamo will run that call eagerly (see refuse). On the
    # class, so that layers pickled before the flag existed have it too.
    refused = False

    def __init__(self, device=None) -> None:
        self.calls = torch.zeros((), dtype=torch.int64, device=device)
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # a call failed since check_sync()
        self.bad_tail = torch.zeros(TAIL, dtype=torch.int64, device=device)  # first such reduced tail

    def to(self, device) -> Counters:
        if self.calls.is_meta:  # a layer built on meta has made no call: fresh counters where it goes
            return Counters(device)
        moved = Counters.__new__(Counters)
        moved.calls, moved.bad, moved.bad_tail = (t.to(device) for t in (self.calls, self.bad, self.bad_tail))
        moved.refused = self.refused
        return moved


# Layers with compiled calls, by id (their own __eq__/__hash__ are never called): (layer, name, world size)
_prepared: dict[int, tuple[weakref.ref, str, int]] = {}


def _remember(layer, name: str, world_size: int) -> None:
    key = id(layer)

    def forget(ref: weakref.ref) -> None:
        if _prepared.get(key, (None,))[0] is ref:
            del _prepared[key]

    _prepared[key] = (weakref.ref(layer, forget), name, world_size)


# Every synchronized layer of this process under a key of its own, an int attribute of the layer: what a
# traced forward hands to prepare (dynamo calls functions at trace time with constant arguments only).
_layers: dict[int, weakref.ref] = {}
_next_key = itertools.count()


def register(layer) -> int:
    """Give ``layer`` its key for :func:`prepare` (at construction, conversion, unpickling, deep copy)."""
    key = next(_next_key)
    _layers[key] = weakref.ref(layer, lambda ref, key=key: _layers.pop(key, None))
    return key


def prepare(key: int) -> int:
    """Run at trace time, outside the graph, for the layer registered under ``key``: the size of its
    group (0: nobody to sync with). Also resolves the layer's identity as in eager mode and keeps its tail
    template on the layer."""
    layer = _layers[key]()
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    world_size = dist.get_world_size(layer.process_group)
    state = layer._sync_state
    if state.identity is None:  # alone in its group too (DDP leaves the same buffers out on every rank)
        meet_callers(layer, world_size)
    if world_size <= 1:
        return 0
    first = dist.get_rank(layer.process_group) == 0
    layer._sync_template = (*_template(world_size, first, state.identity), call_modulus(world_size))
    _remember(layer, state.layer_name, world_size)
    return world_size


# dynamo calls it at trace time and bakes in its result (without importing dynamo at distsync's import)
_torch_compat.mark_constant_for_dynamo(prepare)


def _template(world_size: int, first: bool, identity: int) -> tuple[list[float], list[float]]:
    """The forward tail of call 0 with a count of 0, and what call^2 adds to it (``_identity`` layout)."""
    modulus = call_modulus(world_size)
    fixed = [(identity // modulus**i) % modulus for i in range(LAYER_DIGITS)] + [FORWARD]
    guard = (1.0 if first else 0.0) - world_size * float(sum(v * v for v in fixed))
    row = [0.0, 0.0, *map(float, fixed), 0.0, *(float(v * v) for v in fixed), 0.0, guard]
    squares = [0.0] * TAIL
    squares[SQUARES.stop - 1], squares[GUARD] = 1.0, -float(world_size)
    return row, squares


def refuse(key: int, channels: int) -> int:
    """Run at trace time, outside the graph, for the layer registered under ``key`` when this rank rejects
    the input of a call of ``channels`` channels: take part in the call's all-reduce as the peers' compiled
    graphs make it, with this rank's failure flagged in the tail, so that their verdict of the call holds
    it (:func:`distsync.check_sync` raises it on each of them). The traced code then raises the problem
    itself (a message made of the traced input's sizes, which dynamo cannot hand to this function): under
    ``fullgraph=True`` as dynamo's error, which quotes it; otherwise dynamo traces the frame again to break
    the graph there and runs the call eagerly, where ``Counters.refused`` makes it raise the problem,
    sending nothing more."""
    layer = _layers[key]()
    t: Counters = layer._counters
    if t.refused:  # dynamo traces the frame again to break its graph there: sent already
        return 0
    row, squares, modulus = layer._sync_template
    tail = _call_tail(row, squares, float(int(t.calls) % modulus), t.calls.device)  # no values: count 0
    payload = _payload.failed_row(torch.cat([tail.new_zeros(2 * channels + _padding(channels)), tail]))
    dist.all_reduce(payload, group=layer.process_group or dist.group.WORLD)
    t.calls.add_(1)
    # Under fullgraph=True dynamo raises to the caller: no eager rerun follows, none must be waited for
    t.refused = not _torch_compat.traced_as_one_graph()
    return 0


_torch_compat.mark_constant_for_dynamo(refuse)


def sync_batch_norm(
    layer,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    eps: float,
    channels: int,
) -> Tensor:
    """Training-mode batch norm of a synchronized layer in traceable ops (after :func:`prepare`), with
    ``F.batch_norm``'s arguments (``momentum=None``: a cumulative average, counted in
    ``num_batches_tracked``) and the number of channels, a constant (the input's sizes may be symbolic)."""
    t: Counters = layer._counters
    c = channels
    nd = input.dim()
    dims = [0, *range(2, nd)]
    dtype = _payload.stat_dtype(input.dtype)
    n = input.numel() // c
    # The eager payload's layout, [n m, n (v + m^2) | tail], as float64 sums around zero
    # (inductor fuses the upcast into the reductions): a mean 10^k standard deviations from zero costs 2k
    # of float64's 16 digits of the variance. A merge shift kept on the device and updated in place would
    # be read back wrongly by AOT autograd, which may save graph inputs for backward.
    wide = input.to(torch.float64)
    first = wide.sum(dims)
    second = (wide * wide).sum(dims)
    row, squares, modulus = layer._sync_template
    tail = _call_tail(row, squares, t.calls.remainder(modulus).to(torch.float64), input.device)
    tail = tail + n * _unit(COUNT, tail)
    pad = tail.new_zeros(_padding(c))  # the eager payload's size class
    payload = torch.cat([first, second, pad, tail])
    group = layer.process_group or dist.group.WORLD
    reduced = _SumOverRanks.apply(payload, group)
    red_tail = reduced[reduced.numel() - TAIL :].detach()
    count = red_tail[COUNT]
    mean = reduced[:c] / count
    var = (reduced[c : 2 * c] / count - mean * mean).clamp_min(0.0)
    healthy = _payload.agreed(red_tail).view(())
    with torch.no_grad():
        t.calls.add_(1)
        bad = ~healthy | (count.detach() == 1)  # what the eager verdict raises for (training mode)
        t.bad_tail.copy_(torch.where(bad & ~t.bad, red_tail.to(torch.int64), t.bad_tail))
        t.bad.logical_or_(bad)
        if running_mean is not None and running_var is not None:
            buffers = (running_mean, running_var, num_batches_tracked)
            _update_running_stats(buffers, momentum, mean.detach(), var.detach(), count.detach(), healthy)
    if layer.eps_mode == "clamp":
        invstd = var.clamp_min(eps).rsqrt()
    else:
        invstd = (var + eps).rsqrt()
    shape = (1, -1, *[1] * (nd - 2))
    output = (input.to(dtype) - mean.to(dtype).view(shape)) * invstd.to(dtype).view(shape)
    if weight is not None:
        output = output * weight.to(dtype).view(shape)
    if bias is not None:
        output = output + bias.to(dtype).view(shape)
    return output.to(input.dtype)


class _SumOverRanks(torch.autograd.Function):
    """The payload summed over the group, whose gradient is the gradient summed over the group: the
    functional all-reduce (traceable), with its backward written out (torch registers one for that op
    only from 2.8 or so; before, gradients would silently stop at the sum)."""

    @staticmethod
    def forward(ctx, payload: Tensor, group) -> Tensor:
        ctx.group = group
        return _torch_compat.traceable_all_reduce(payload, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _torch_compat.traceable_all_reduce(grad, ctx.group), None


def _call_tail(row: list[float], squares: list[float], call, device) -> Tensor:
    """The forward tail of call number ``call`` (a float, or a float64 tensor in the graph) with a count
    of 0, from the layer's template (:func:`_template`), on ``device``."""
    template = torch.tensor(row, dtype=torch.float64, device=device)
    return template + call * _unit(CALL, template) + call * call * template.new_tensor(squares)


def _padding(channels: int) -> int:
    """Zeros between a payload's statistics and its tail (a constant at trace time)."""
    return payload_size(channels) - 2 * channels - TAIL


_torch_compat.mark_constant_for_dynamo(_padding)  # int.bit_length is not traceable before torch 2.6


def _unit(index: int, like: Tensor) -> Tensor:
    unit = torch.zeros_like(like)
    unit[index] = 1.0
    return unit


def _update_running_stats(
    buffers, momentum: float | None, mean: Tensor, var: Tensor, count: Tensor, healthy: Tensor
) -> None:
    """``nn.BatchNorm``'s update, ``(1 - w) * buffer + w * statistic``, where the call counts (healthy, more
    than one value): a NaN statistic then becomes a NaN buffer, as there, and an inf buffer stays inf. A call
    that does not count leaves the buffers as they are, bit for bit."""
    running_mean, running_var, num_batches_tracked = buffers
    unbiased = var * count / (count - 1).clamp_min(1.0)
    if num_batches_tracked is not None:
        num_batches_tracked.add_(healthy.long())
    if momentum is None:
        weight = healthy.double() / num_batches_tracked.clamp_min(1).double()
    else:
        weight = healthy.double() * momentum
    counts = healthy & (count > 1)
    for buffer, end in ((running_mean, mean), (running_var, unbiased)):
        old = buffer.double()
        buffer.copy_(torch.where(counts, old * (1 - weight) + end * weight, old).to(buffer.dtype))


def check() -> None:
    """Raise the first failed check among compiled calls since the last call (reads device flags)."""
    for ref, name, world_size in list(_prepared.values()):
        layer = ref()
        if layer is None:
            continue
        t: Counters = layer._counters
        if not bool(t.bad):
            continue
        tail = [float(v) for v in t.bad_tail.tolist()]
        t.bad.fill_(False)
        call = int(round(tail[CALL] / world_size))
        tag = CallTag(layer._sync_state.identity or 0, FORWARD, call, name)
        _payload.raise_for(_payload.verdict(tail, world_size), tag, world_size, None, True)
