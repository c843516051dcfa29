"""Batch-norm modules whose batch statistics are synchronized across ranks."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import handle_torch_function, has_torch_function

from distsync import _torch_compat
from distsync._syncbn import checkpointing as _checkpointing
from distsync._syncbn import compiled as _compiled
from distsync._syncbn import fx as _fx
from distsync._syncbn.payload import Reducer, SyncState, process_group_reducer, stat_dtype
from distsync._syncbn.unwrapped import meet_callers
from distsync.functional import SyncBatchNormFunction, SyncCall
from distsync.groups import GroupSpec, as_process_group

__all__ = [
    "BatchNormNd",
    "DistSyncBatchNorm",
    "DistSyncBatchNorm1d",
    "DistSyncBatchNorm2d",
    "DistSyncBatchNorm3d",
    "DistSyncSyncBatchNorm",
]

# nn.BatchNorm takes ``bias`` from torch 2.12 on; before, its layers always have a bias when affine.
_TAKES_BIAS = "bias" in inspect.signature(_BatchNorm.__init__).parameters


# Called after every training call of a synchronized layer with its input and synchronized output (None where
# it normalized locally): the recorders of precise BN and of Join.
_call_observers: list[Callable[[DistSyncBatchNorm, Tensor, Tensor | None], None]] = []
# Called before a synchronized call of a layer that is in no Join while one is on in this process: the
# Join's check (distsync.join), which raises for a layer a rank that joined could not take part with.
_outside_join: list[Callable[[DistSyncBatchNorm], None]] = []


@functools.cache
def _warn_unwired_replica() -> None:
    warnings.warn(
        "DistSyncBatchNorm was replicated by nn.DataParallel without the replication callback, so it cannot "
        "sync across devices and uses each replica's own batch statistics. Wrap the model in "
        "distsync.parallel.ReplicationCallbackDataParallel (or call patch_replication_callback on your "
        "DataParallel), or better, move to torchrun + DistributedDataParallel.",
        RuntimeWarning,
        stacklevel=3,
    )


def _warn_vendored(names: tuple[str, ...]) -> None:
    warnings.warn(
        f"loading a vendored Synchronized-BatchNorm checkpoint: dropped its {', '.join(names)} buffers "
        "(its running_mean/running_var already hold the running statistics). Such forks often default to "
        "another momentum (e.g. 0.001): see docs/migration.md.",
        UserWarning,
        stacklevel=4,
    )


class BatchNormNd(_BatchNorm):
    """Plain batch norm accepting any input rank >= 2: the local twin of a rank-agnostic sync layer."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


# Each class names _BatchNorm among its direct bases, as torch's batch-norm classes do: code that matches
# layers by their class's name and direct bases (mmengine's init_cfg, layer="_BatchNorm") finds them too.
class DistSyncBatchNorm(BatchNormNd, _BatchNorm):
    r"""Batch normalization over the union of the batches of all ranks of a process group.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    Mean and variance are computed per channel over the concatenation of every rank's batch, exactly as
    ``nn.BatchNorm`` would on the global batch: one ``all_reduce`` of moment statistics (O(C), independent
    of the world size) per forward and one per backward. Uneven and empty per-rank batches are exact.
    Works on any device and backend (gloo on CPU included). Parameters, buffers and ``state_dict`` keys are
    those of ``nn.BatchNorm*``, so checkpoints load both ways.

    Without an initialized process group, or with a group of one rank, it is exactly ``nn.BatchNorm``.
    Like ``nn.SyncBatchNorm`` it synchronizes in training mode only: in eval mode each rank uses its
    running statistics, or with ``track_running_stats=False`` its own batch's statistics, and never
    communicates. In training mode every rank of the group must call the layer in the same order.
    Ranks out of step raise :class:`distsync.SyncMismatchError` on every rank; on the CPU at once, on
    GPUs at a later synchronized call or :func:`distsync.check_sync` (the checks run on the device).

    A layer is identified across ranks by its module path from the root of its model (wrappers such as
    DDP or ``torch.compile`` left out) and its width, so processes may build other modules (an EMA copy, a
    probe), wrap the model differently or load it whole without confusing it. A deep copy of a layer is a
    different layer than its original. Separately built models of one structure share their paths: name
    them with :func:`distsync.name_layers` when ranks may call them in different orders.

    Args:
        num_features: number of channels :math:`C` of an input of size :math:`(N, C, *)`
        eps: value added to the denominator for numerical stability. Default: 1e-5
        momentum: weight of the new batch in the running statistics, or ``None`` for a cumulative
            average. Default: 0.1
        affine: learnable per-channel scale and shift. Default: ``True``
        track_running_stats: keep running mean and variance for eval mode. Default: ``True``
        process_group: ranks whose statistics are combined: a process group, a one-dimensional
            ``DeviceMesh`` or ``(mesh, dim)``. Default: ``None`` (the default group).
            PyTorch-Encoding's positional form ``DistSyncBatchNorm(C, eps, momentum, process_group)``
            is accepted too.
        bias: learnable per-channel shift (with ``affine``; ``False`` needs torch >= 2.12, as
            ``nn.BatchNorm``). Default: ``True``

    Shape:
        - Input: :math:`(N, C, *)`, any rank >= 2, any memory format
        - Output: same shape, dtype and memory format as the input

    Examples::

        >>> # under torchrun, after distsync.init_distributed()
        >>> bn = distsync.DistSyncBatchNorm(64)
        >>> out = bn(torch.randn(8, 64, 16, 16))
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: GroupSpec = None,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        if isinstance(affine, dist.ProcessGroup):  # PyTorch-Encoding: (num_features, eps, momentum, group)
            affine, process_group = True, affine
        factory = {"device": device, "dtype": dtype}
        if _TAKES_BIAS:
            factory["bias"] = bias
        elif not bias:
            raise TypeError(
                f"bias=False needs torch >= 2.12, where nn.BatchNorm takes it (this is {torch.__version__})"
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **factory)
        self._init_sync(process_group)

    # What a synchronized layer holds besides a batch-norm layer's state (dropped again by revert).
    _SYNC_ATTRIBUTES = (
        "process_group",
        "_sync_state",
        "_replica_reducer",
        "_counters",
        "_compile_key",
        "_sync_template",
        "_updates_running_stats",
    )

    def _init_sync(self, process_group: GroupSpec) -> None:
        """Add the synchronization state to a batch-norm layer (from the constructor, or on conversion)."""
        self.process_group = as_process_group(process_group)
        self._sync_state = SyncState()
        self._replica_reducer: Reducer | None = None
        tensors = (*self._parameters.values(), *self._buffers.values())
        device = next((t.device for t in tensors if t is not None), None)
        self._counters = _compiled.Counters(device)  # call count and verdict of compiled calls
        self._compile_key = _compiled.register(self)

    def _apply(self, fn, recurse: bool = True):
        result = super()._apply(fn, recurse)
        # Follow the module's device (not its dtype: the counters are integers; torch's conversion functions
        # leave an integer tensor's dtype alone): where ``fn`` takes a tensor that is where they are, so that
        # a dtype conversion (``.half()``, ``.to(torch.bfloat16)``) leaves them on the module's device.
        probe = torch.zeros(0, dtype=torch.int64, device=self._counters.calls.device)
        try:
            device = fn(probe).device
        except NotImplementedError:  # no copy out of meta (a layer without tensors built there): from CPU
            device = fn(torch.zeros(0, dtype=torch.int64, device="cpu")).device
        self._counters = self._counters.to(device)
        return result

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._compile_key = _compiled.register(self)  # this object's own (a deep copy is another layer)
        if "_counters" not in self.__dict__:  # a layer pickled whole before compiled calls were counted
            self._counters = _compiled.Counters(
                self.num_batches_tracked.device if self.track_running_stats else None
            )

    eps_mode = "plus"
    """How eps enters the synchronized statistics: ``"plus"``, ``sqrt(var + eps)`` (``nn.BatchNorm``), or
    ``"clamp"``, ``sqrt(max(var, eps))`` (Synchronized-BatchNorm's default; see ``distsync.parallel``)."""

    # Buffers that vendored Synchronized-BatchNorm forks keep next to the running statistics (for their own
    # bias-corrected running average, already folded into running_mean/var): dropped on load.
    _VENDORED_BUFFERS = ("_tmp_running_mean", "_tmp_running_var", "_running_iter")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        dropped = [name for name in self._VENDORED_BUFFERS if state_dict.pop(prefix + name, None) is not None]
        if dropped:
            _warn_vendored(tuple(dropped))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script asks every module before compiling it: refuse with the way out, not a parse error.
        where = f" at '{self._sync_state.path}'" if self._sync_state.path else ""
        raise RuntimeError(
            f"torch.jit.script cannot compile distsync's {type(self).__name__}{where}: its synchronization "
            "across ranks is Python code. For export or inference, script "
            "distsync.revert_sync_batchnorm(copy.deepcopy(model)), whose batch norms are torch's own; to "
            "compile a synchronized model for training, use torch.compile."
        )

    def _layer_name(self) -> str:
        return self._sync_state.layer_name or type(self).__name__

    def _input_problem(
        self, input: Tensor, channels: int, eps: float, check_dim: bool, tensors: tuple[Tensor | None, ...]
    ) -> str | None:
        """What makes ``input`` unfit for a synchronized training call (None if nothing): what
        ``F.batch_norm`` would refuse, and with ``check_dim`` the layer's own input-rank check.
        ``tensors`` are the call's weight, bias and running statistics (None where absent)."""
        try:
            if check_dim:
                self._check_input_dim(input)
            elif input.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        except ValueError as error:
            return f"{self._layer_name()}: {error}"
        if input.shape[1] != channels:
            return (
                f"{self._layer_name()}: expected {channels} channels in dimension 1, "
                f"got input of size {list(input.shape)}"
            )
        if not input.is_floating_point():
            return f"{self._layer_name()}: expected a floating-point input, got {input.dtype}"
        if not eps > 0:  # what F.batch_norm checks in training
            return f"{self._layer_name()}: batch_norm eps must be positive during training, got {eps}"
        # Each in the input's dtype or its statistics' (float32 for a half input: torch's mixed precision, and
        # FSDP2's bfloat16 parameters with float32 running statistics). nn.BatchNorm refuses the rest, in eval
        # mode too (a float64 input into a float32 layer, a float32 input into a half one).
        allowed = (input.dtype, stat_dtype(input.dtype))
        wrong = next((t.dtype for t in tensors if t is not None and t.dtype not in allowed), None)
        if wrong is not None:
            return (
                f"{self._layer_name()}: expected its parameters and running statistics in the input's dtype "
                f"{input.dtype} (or float32 for a float16 or bfloat16 input), got {wrong}; convert the layer "
                "or the input"
            )
        return None

    # DataParallel copies other than copy 0 hold copies of the buffers: only copy 0 updates running stats.
    _updates_running_stats = True

    def __data_parallel_replicate__(self, ctx, copy_id: int) -> None:
        """Sync this copy with the other ``nn.DataParallel`` copies of the layer (replication callback).

        Called on every copy, copy 0 first, by :class:`distsync.parallel.ReplicationCallbackDataParallel`.
        Each copy gets its own call counter and a reducer over the copies in this process, then over the
        ranks of ``process_group`` if one is initialized. Only copy 0, whose buffers are the module's own,
        updates the running statistics.
        """
        from distsync.parallel.replica_sync import replica_reducer  # distsync.parallel imports this module

        self._sync_state = self._sync_state.fresh_copy()
        self._replica_reducer = replica_reducer(ctx, copy_id, self.process_group)
        self._updates_running_stats = copy_id == 0

    def _reducer(self) -> Reducer | None:
        """Who this layer syncs with right now, or None to behave like plain BatchNorm. Under a process group,
        a layer alone in its group meets its callers at its first call as a synchronized layer does."""
        if self._replica_reducer is not None:
            return self._replica_reducer
        if getattr(self, "_is_replica", False):  # copied by nn.DataParallel but not wired by the callback
            _warn_unwired_replica()
            return None
        state = self._sync_state
        inside_join = state.join
        if inside_join is not None and inside_join.world_size > 1:
            return inside_join  # DDP's Join: the join's group, calls announced to the ranks that joined
        if not (dist.is_available() and dist.is_initialized()):
            return None
        # The same group object (the default one: the same until it is destroyed) gives the same reducer.
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        cached = state.transport
        if cached is None or cached[0] is not group:
            cached = state.transport = (group, process_group_reducer(self.process_group))
        reducer = cached[1]
        if reducer is None:
            if state.identity is None:  # alone in its group: its statistics leave DDP's broadcast too
                meet_callers(self, 1)
            return None
        for check in _outside_join:
            check(self)
        return reducer

    def forward(self, input: Tensor) -> Tensor:
        # symbolically traced (a proxy is no tensor): one call_module node, like nn.BatchNorm's
        if not isinstance(input, Tensor) and _fx.is_proxy(input):
            return _fx.leaf_call(self, input)
        if self.training:  # distsync's own ops: selective activation checkpointing sees none of them
            return _checkpointing.outside_selective(self._training_forward, input)
        return _BatchNorm.forward(self, input)  # not super(): after DistSyncSyncBatchNorm's is SyncBatchNorm

    def _training_forward(self, input: Tensor) -> Tensor:
        update = self.track_running_stats and self._updates_running_stats
        buffers = (self.running_mean, self.running_var, self.num_batches_tracked)
        if not update:
            buffers = (None, None, None)
        output = self._sync_batch_norm(
            input, self.weight, self.bias, *buffers, self.momentum, self.eps, check_dim=True
        )
        if output is not None:
            return output
        if _checkpointing.replaying():  # nobody to sync with: the same batch norm, the statistics moved once
            running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
            momentum = 0.0 if self.momentum is None else self.momentum  # the output does not depend on it
            copies = _checkpointing.copies(running)
            return F.batch_norm(input, *copies, self.weight, self.bias, True, momentum, self.eps)
        return _BatchNorm.forward(self, input)

    def _sync_batch_norm(
        self,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        num_batches_tracked: Tensor | None,
        momentum: float | None,
        eps: float,
        check_dim: bool = False,
        problem: str | None = None,
    ) -> Tensor | None:
        """Training-mode batch norm of ``input`` with the statistics of the group's global batch, or None
        where there is nobody to sync with (the caller then normalizes locally, as ``nn.BatchNorm`` does).

        The arguments are those of ``F.batch_norm``. ``momentum=None`` is a cumulative average over
        ``num_batches_tracked``, which this call then counts (healthy calls only); a converted subclass
        passes the factor its own forward computed, and no counter (that forward counted). A ``problem``
        (a message) makes every participant raise at this call, this one with ``ValueError(problem)``.
        """
        output = self._synced_output(
            torch.compiler.is_compiling(),
            input,
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
            momentum,
            eps,
            check_dim,
            problem,
        )
        for observe in _call_observers:
            observe(self, input, output)
        return output

    def _synced_output(
        self, compiled, input, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
        check_dim, problem,
    ) -> Tensor | None:  # fmt: skip
        if compiled and not (
            _compiled.TRACEABLE and self._replica_reducer is None and self._sync_state.join is None
        ):
            # DataParallel replicas, layers inside DDP's Join (a joined rank learns each call from an
            # announcement) and torch releases whose compiler cannot trace the sync: this call runs eagerly
            # between two graphs (the same result; fullgraph=True refuses the break). Told so, not asked
            # again: non-strict torch.export (torch < 2.11) still says it is compiling inside.
            return _synced_output_untraced(
                self, False, input, weight, bias, running_mean, running_var, num_batches_tracked, momentum,
                eps, check_dim, problem,
            )  # fmt: skip
        # Traced whole (fullgraph): identity and group size are resolved at trace time, outside the graph.
        reducer = None if compiled else self._reducer()
        if not (_compiled.prepare(self._compile_key) if compiled else reducer):
            return None  # nobody to sync with: checked before anything else, as no input needs checking
        channels = _channels(weight, running_mean, self.num_features)
        if problem is None:
            tensors = (weight, bias, running_mean, running_var)
            problem = self._input_problem(input, channels, eps, check_dim, tensors)
        if compiled:
            if problem is not None:  # shapes and dtypes are static while tracing: refused at trace time
                _compiled.refuse(self._compile_key, channels)
                raise ValueError(problem)
            return _compiled.sync_batch_norm(
                self, input, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                channels,
            )  # fmt: skip
        if problem is not None and self._counters.refused:  # dynamo's eager rerun of a call it refused
            self._counters.refused = False
            raise ValueError(problem)
        arguments = (weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, channels)
        if has_torch_function((input,)):
            # A tensor subclass (MONAI's MetaTensor, ...) wraps the call as it wraps F.batch_norm's: the
            # autograd Function sees plain tensors, its output becomes the subclass outside the Function (so
            # in-place ops after the layer work), with the subclass's metadata.
            return handle_torch_function(_apply_sync, (input,), input, self, *arguments, reducer, problem)
        return _apply_sync(input, self, *arguments, reducer, problem)


class DistSyncBatchNorm1d(nn.BatchNorm1d, DistSyncBatchNorm, _BatchNorm):
    """:class:`DistSyncBatchNorm` for :math:`(N, C)` or :math:`(N, C, L)` inputs: an ``nn.BatchNorm1d``."""


class DistSyncBatchNorm2d(nn.BatchNorm2d, DistSyncBatchNorm, _BatchNorm):
    """:class:`DistSyncBatchNorm` for :math:`(N, C, H, W)` inputs: an ``nn.BatchNorm2d``."""


class DistSyncBatchNorm3d(nn.BatchNorm3d, DistSyncBatchNorm, _BatchNorm):
    """:class:`DistSyncBatchNorm` for :math:`(N, C, D, H, W)` inputs: an ``nn.BatchNorm3d``."""


class DistSyncSyncBatchNorm(nn.SyncBatchNorm, DistSyncBatchNorm, _BatchNorm):
    """What ``convert_sync_batchnorm`` makes of an ``nn.SyncBatchNorm``: still an ``nn.SyncBatchNorm`` (any
    input rank >= 2, its ``process_group``), synchronized by :class:`DistSyncBatchNorm`, on any device."""

    # DistSyncBatchNorm's, not nn.SyncBatchNorm's (which syncs by itself, on GPUs only)
    __init__ = DistSyncBatchNorm.__init__
    forward = DistSyncBatchNorm.forward


def _channels(weight: Tensor | None, running_mean: Tensor | None, num_features: int) -> int:
    """How many channels a call normalizes: its parameters', else the layer's (plain branches: traced by
    every dynamo release)."""
    if weight is not None:
        return weight.numel()
    if running_mean is not None:
        return running_mean.numel()
    return num_features


def _apply_sync(
    input: Tensor, layer: DistSyncBatchNorm, weight, bias, running_mean, running_var, num_batches_tracked,
    momentum, eps, channels, reducer: Reducer, problem: str | None,
) -> Tensor:  # fmt: skip
    """The synchronized training call of ``layer`` in eager mode: its autograd Function."""
    state = layer._sync_state
    if state.identity is None:
        meet_callers(layer, reducer.world_size)
    call = SyncCall(
        running_mean, running_var, num_batches_tracked, momentum, eps, layer.eps_mode == "clamp", channels,
        reducer, state, problem,
    )  # fmt: skip
    try:
        return SyncBatchNormFunction.apply(input, weight, bias, call)
    except RuntimeError as error:
        # Tracers that cannot run this eager call fail in it, on every rank that traces: the JIT tracer at
        # the Function's arguments, before anything runs; non-strict torch.export, where the compiler
        # cannot trace the sync, at the first host read (CPU) or collective of a fake tensor. Say why, and
        # the way out.
        if torch.jit.is_tracing():
            raise RuntimeError(_untraceable(layer, "torch.jit.trace cannot record")) from error
        if torch.compiler.is_compiling():
            raise RuntimeError(_untraceable(layer, "torch.export cannot capture")) from error
        raise


def _untraceable(layer: DistSyncBatchNorm, tracer_cannot: str) -> str:
    return (
        f"{tracer_cannot} the synchronized training call of {layer._layer_name()}: its all-reduce and "
        "statistics are Python code run at the call. Trace or export the model in eval mode (model.eval(): "
        "the layer is then nn.BatchNorm's); to capture the synchronized training call itself, use "
        "torch.export or torch.compile on torch >= 2.11 (outside nn.DataParallel's replicas and DDP's Join)"
    )


# torch.compiler.disable, with dynamo imported at the first call (only ever made while compiling) rather
# than when distsync is imported.
_synced_output_untraced = _torch_compat.disable_dynamo(DistSyncBatchNorm._synced_output)
