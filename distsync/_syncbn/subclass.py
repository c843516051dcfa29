"""Synchronized twins of batch-norm subclasses: the subclass's own forward, with its normalization synced.

Model libraries subclass ``nn.BatchNorm*d`` to fuse more into the layer: timm's ``BatchNormAct2d`` applies an
activation and dropout held in child modules, others add checks, parameters or buffers. Replacing such a
layer by a plain synchronized one would silently change the network. Its twin is a class derived from both
the subclass and :class:`DistSyncBatchNorm`: an instance holds the subclass's state as it was (children,
parameters, buffers, attributes) and runs the subclass's forward. In training mode the batch-norm computation
that forward makes through ``F.batch_norm`` or ``torch.batch_norm``, directly or through the base class's
forward, is routed to the synchronized layer by a ``TorchFunctionMode`` active during that forward only
(``torch.compile`` traces it too). A forward that makes no such call computes its statistics some other way,
which cannot be synchronized: its first training call raises, on every rank. Under ``torch.fx``
symbolic tracing a twin is recorded as the tracer records the subclass (a leaf, or its forward traced
through with the batch-norm call synchronized), and mmengine's ``init_cfg``, which matches a layer by the
names of its class and of that class's direct bases, finds the twin by the subclass's names.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from distsync import _torch_compat
from distsync._syncbn import checkpointing as _checkpointing
from distsync._syncbn import compiled as _compiled
from distsync._syncbn import fx as _fx
from distsync.batchnorm import BatchNormNd, DistSyncBatchNorm

__all__ = ["class_listing_bases", "original_class", "synchronized_batch_norm", "twin_class"]

# The batch-norm functions a subclass's forward may call, with their parameter names in order.
_STATS, _REST = ("running_mean", "running_var"), ("training", "momentum", "eps")
_SIGNATURES = {
    F.batch_norm: ("input", *_STATS, "weight", "bias", *_REST),
    torch.batch_norm: ("input", "weight", "bias", *_STATS, *_REST),  # and cudnn_enabled
}
_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


class _RouteBatchNorm(TorchFunctionMode):
    """Within a twin's training forward: send its batch-norm calls to the synchronized layer. Under a
    ``torch.fx`` symbolic trace (``tracer``), a training call is recorded as a call of
    :func:`synchronized_batch_norm` instead, so that the traced graph synchronizes when it runs."""

    def __init__(self, layer: DistSyncBatchNorm, tracer=None) -> None:
        super().__init__()
        self.layer = layer
        self.tracer = tracer
        self.calls = 0  # batch-norm calls seen, synchronized or not

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        names = _SIGNATURES.get(func)
        if names is None:
            return func(*args, **kwargs)
        self.calls += 1
        call = {**_DEFAULTS, **dict(zip(names, args, strict=False)), **kwargs}
        if call["training"] is False:  # normalizes with the statistics it is given: nothing to sync
            return func(*args, **kwargs)
        arguments = (self.layer, *(call[name] for name in _SIGNATURES[F.batch_norm]))
        if self.tracer is not None:  # the graph calls the layer's sync when it runs
            return self.tracer.create_proxy("call_function", synchronized_batch_norm, arguments, {})
        # distsync's own ops: selective activation checkpointing sees none of them
        return _checkpointing.outside_selective(self._training_call, func, names, args, kwargs, arguments)

    def _training_call(self, func, names: tuple[str, ...], args: tuple, kwargs: dict, arguments: tuple):
        output = _synced_or_none(*arguments)
        if output is not None:
            return output
        if _checkpointing.replaying():  # nobody to sync with: the same batch norm, the statistics moved once
            running = _checkpointing.copies(arguments[2:4])  # (running_mean, running_var)
            args, kwargs = _replaced(names, args, kwargs, dict(zip(_STATS, running, strict=True)))
        return func(*args, **kwargs)


def _replaced(names: tuple[str, ...], args: tuple, kwargs: dict, values: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call of a function with parameters ``names``, with ``values`` in place of
    the arguments so named."""
    args, kwargs = list(args), dict(kwargs)
    for name, value in values.items():
        index = names.index(name)
        if index < len(args):
            args[index] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def _synced_or_none(
    layer: DistSyncBatchNorm, input, running_mean, running_var, weight, bias, training, momentum, eps
) -> Tensor | None:
    """``F.batch_norm``'s call, synchronized by ``layer``; None where it normalizes locally (not training,
    or nobody to sync with)."""
    if not training:
        return None
    updates = layer._updates_running_stats  # DataParallel copies other than copy 0 do not
    return layer._sync_batch_norm(
        input,
        weight,
        bias,
        running_mean if updates else None,
        running_var if updates else None,
        None,  # the subclass's forward counts num_batches_tracked itself, as it did before
        momentum,
        eps,
    )


def synchronized_batch_norm(
    layer: DistSyncBatchNorm,
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """``F.batch_norm`` as a converted subclass's forward calls it, synchronized by the twin ``layer``: what
    a ``torch.fx`` graph traced through that forward calls in its place."""
    output = _synced_or_none(layer, input, running_mean, running_var, weight, bias, training, momentum, eps)
    if output is None:
        output = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    return output


def _unsyncable(layer: DistSyncBatchNorm) -> str:
    name = original_class(type(layer)).__name__
    return (
        f"{name} cannot be synchronized: its forward computes its batch statistics without F.batch_norm or "
        f"the base class's forward, so distsync has nothing to route through the sync. Make {name}.forward "
        "normalize with F.batch_norm (or super().forward()), or replace the layer before converting (e.g. by "
        "a distsync.DistSyncBatchNorm followed by what its forward adds)."
    )


def _refuse(layer: DistSyncBatchNorm, args: tuple) -> None:
    """Raise for a twin whose forward made no batch-norm call: on every rank, through the sync."""
    message = _unsyncable(layer)
    input = args[0] if args else None
    if isinstance(input, Tensor) and input.dim() >= 1:  # the peers at this call learn it from the sync
        layer._sync_batch_norm(input, None, None, None, None, None, 0.0, layer.eps, problem=message)
    raise ValueError(message)


def _twin_forward(twin: type):
    def forward(self, *args, **kwargs):
        # symbolically traced (a proxy is no tensor): as the tracer sees the original class
        if args and not isinstance(args[0], Tensor) and _fx.is_proxy(args[0]):
            return _traced_forward(twin, self, args, kwargs)
        if not self.training:
            return super(twin, self).forward(*args, **kwargs)
        if torch.compiler.is_compiling() and not _compiled.TRACEABLE:
            return _routed_forward_untraced(twin, self, args, kwargs)  # between two graphs, as in eager
        return _routed_forward(twin, self, args, kwargs)

    return forward


def _traced_forward(twin: type, self: DistSyncBatchNorm, args: tuple, kwargs: dict):
    """A twin under ``torch.fx`` symbolic tracing, recorded as the tracer records the subclass: one
    ``call_module`` node where it keeps the subclass a leaf, else the subclass's own forward traced through
    (its activation and other operations kept, as conv-BN fusers and mmengine's ``efficient_conv_bn_eval``
    saw them), its training-mode batch norm recorded as a synchronized call."""
    proxy = args[0]
    if _fx.traced_as_leaf(proxy, self, original_class(twin)):
        return _fx.leaf_call(self, proxy)
    route = _RouteBatchNorm(self, proxy.tracer)
    with route:
        output = super(twin, self).forward(*args, **kwargs)
    if route.calls == 0 and self.training:  # the graph would normalize each rank's batch by itself
        raise ValueError(_unsyncable(self))
    return output


def _routed_forward(twin: type, self: DistSyncBatchNorm, args: tuple, kwargs: dict):
    """A twin's training forward: the subclass's own, its batch-norm calls routed to the sync."""
    original = super(twin, self).forward
    route = _RouteBatchNorm(self)
    counted = self.num_batches_tracked
    recomputed = counted is not None and _checkpointing.replaying()
    before = _checkpointing.outside_selective(counted.clone) if recomputed else None  # the forward again
    try:
        with route:
            output = original(*args, **kwargs)
    finally:
        if recomputed:  # counted once, as without checkpointing (which may stop a recomputation early)
            _checkpointing.outside_selective(counted.copy_, before)
    if route.calls == 0:
        input = args[0] if args else None
        if isinstance(input, Tensor) and input.dim() >= 2 and input.numel() == 0:
            return _take_part_without_samples(self, input, output)
        _refuse(self, args)
    return output


def _take_part_without_samples(layer: DistSyncBatchNorm, input: Tensor, output):
    """A forward that skipped batch norm for an empty batch (``if x.numel() == 0: return x``, as detectron2
    and mmcv layers do): this rank still takes part in the call the others make, with no samples, as
    ``_BatchNorm.forward`` would have (counting the batch, by the layer's momentum). Its output is the
    empty result of the synchronized call, which takes part in the backward too."""
    factor = 0.0 if layer.momentum is None else layer.momentum
    counted = layer.num_batches_tracked
    if layer.track_running_stats and counted is not None:
        if not _checkpointing.replaying():
            _checkpointing.outside_selective(counted.add_, 1)
        factor = 1.0 / float(counted) if layer.momentum is None else layer.momentum
    updates = layer.track_running_stats and layer._updates_running_stats
    synced = layer._sync_batch_norm(
        input,
        layer.weight,
        layer.bias,
        layer.running_mean if updates else None,
        layer.running_var if updates else None,
        None,
        factor,
        layer.eps,
    )
    if synced is None:  # nobody to sync with: the subclass's own result
        return output
    if not isinstance(output, Tensor) or output.shape != synced.shape:
        _refuse(layer, (input,))
    return synced


# Where the compiler cannot trace the routing mode (torch < 2.11), the twin's forward runs eagerly.
_routed_forward_untraced = _torch_compat.disable_dynamo(_routed_forward)


@functools.cache
def _local_base(base: type) -> type:
    """``base`` with ``_BatchNorm``'s plain forward as its own attribute: what a twin's ``super().forward()``
    reaches, ahead of ``DistSyncBatchNorm``'s forward (and of ``nn.SyncBatchNorm``'s, which would sync again
    or refuse the CPU)."""
    return type(f"_Local{base.__name__}", (base,), {"forward": _BatchNorm.forward, "__module__": __name__})


@functools.cache
def twin_class(cls: type[_BatchNorm]) -> type[DistSyncBatchNorm]:
    """The synchronized twin of the batch-norm subclass ``cls`` (one class per subclass).

    Its method order is ``twin, cls, ..., local base, base, DistSyncBatchNorm, _BatchNorm``, where base is
    the nearest batch-norm class of torch's (or distsync's ``BatchNormNd``) that ``cls`` derives from: the
    subclass's own methods (``_check_input_dim`` included) come first, its ``super().forward()`` reaches a
    plain local forward whose ``F.batch_norm`` call the twin routes, and ``DistSyncBatchNorm`` adds the
    synchronization.
    """
    base = next(c for c in cls.__mro__ if c.__module__.startswith("torch.") or c is BatchNormNd)
    twin = class_listing_bases(
        f"DistSync{cls.__name__}",
        (cls, _local_base(base), DistSyncBatchNorm),
        {"__module__": __name__, "_distsync_original": cls, "__reduce_ex__": _reduce_ex},
        also=cls.__bases__,
    )
    twin.forward = _twin_forward(twin)
    return twin


def class_listing_bases(name: str, bases: tuple[type, ...], namespace: dict, also: tuple[type, ...]) -> type:
    """``type(name, bases, namespace)``, with the classes of ``also`` among its direct bases too where that
    leaves its method resolution order as it is.

    mmengine's ``init_cfg`` (``dict(type="Constant", layer=["BatchNorm2d"])``) matches a module by the names
    of its class and of that class's direct bases: a class that replaces another lists the other's direct
    bases, so that it is matched wherever the other was.
    """
    plain = type(name, bases, namespace)
    order = plain.__mro__[1:]
    listed = tuple(sorted({*bases, *(c for c in also if c in order)}, key=order.index))
    if listed == bases:
        return plain
    try:
        named = type(name, listed, dict(namespace))
    except TypeError:  # no consistent order
        return plain
    return named if named.__mro__[1:] == order else plain


def original_class(cls: type) -> type | None:
    """The batch-norm subclass a twin class was made for (None for any other class)."""
    return cls.__dict__.get("_distsync_original")


def _reduce_ex(self, protocol):
    # The twin class is made at run time: pickles and copies rebuild it from the subclass (importable).
    return _rebuild, (original_class(type(self)),), self.__getstate__()


def _rebuild(cls: type[_BatchNorm]) -> nn.Module:
    twin = twin_class(cls)
    return twin.__new__(twin)
