"""The DataParallel replication callback: ``__data_parallel_replicate__(ctx, copy_id)`` on every copy.

``nn.DataParallel`` copies the module onto every device in each forward; copies that must talk to each other
(synchronized batch norm) need to be introduced to one another right after. This is the protocol of
jactorch and Synchronized-BatchNorm, kept so their DataParallel code runs unchanged: a migration aid.
New code should use torchrun + ``DistributedDataParallel`` (see ``docs/migration.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from distsync.parallel.comm import SyncMaster

__all__ = [
    "CallbackContext",
    "DataParallelWithCallback",
    "ReplicationCallbackDataParallel",
    "exec_data_parallel_replication_callback",
    "execute_replication_callbacks",
    "patch_replication_callback",
]


class CallbackContext:
    """Shared by the copies of one sub-module during one replication; copies leave what they share on it."""


def exec_data_parallel_replication_callback(modules: Sequence[nn.Module]) -> list[CallbackContext]:
    """Call ``__data_parallel_replicate__(ctx, copy_id)`` on every sub-module of ``modules`` that has it.

    ``modules`` are the copies made by one replication (``modules[i]`` is copy ``i``). The copies are
    isomorphic, so each sub-module position gets one :class:`CallbackContext` shared by its copies. All
    callbacks of the master copy (copy 0) run before any callback of the other copies.

    Returns:
        the contexts, one per sub-module position.
    """
    if not modules:
        return []
    contexts = [CallbackContext() for _ in modules[0].modules()]
    for copy_id, module in enumerate(modules):
        for ctx, sub_module in zip(contexts, module.modules(), strict=True):
            if hasattr(sub_module, "__data_parallel_replicate__"):
                sub_module.__data_parallel_replicate__(ctx, copy_id)
    return contexts


execute_replication_callbacks = exec_data_parallel_replication_callback  # Synchronized-BatchNorm's name


def _abort_siblings(contexts: Sequence[CallbackContext], error: BaseException) -> None:
    """Make every copy waiting on a rendezvous of this replication raise instead of waiting."""
    for ctx in contexts:
        for value in vars(ctx).values():
            if isinstance(value, SyncMaster):
                value.abort(error)


class _AbortSiblingsOnError:
    """A replica as ``parallel_apply`` calls it: when its forward raises, its siblings are released."""

    def __init__(self, replica: nn.Module, copy_id: int, contexts: Sequence[CallbackContext]) -> None:
        self.replica = replica
        self.copy_id = copy_id
        self.contexts = contexts

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            return self.replica(*inputs, **kwargs)
        except BaseException as error:
            _abort_siblings(self.contexts, RuntimeError(f"replica {self.copy_id} failed: {error!r}"))
            raise


def _with_callback(replicas: list[nn.Module]) -> list[nn.Module]:
    contexts = exec_data_parallel_replication_callback(replicas)
    for replica in replicas:
        replica.__dict__["_replication_contexts"] = contexts  # read back by _guarded
    return replicas


def _guarded(replicas: Sequence[nn.Module]) -> list[Callable[..., Any]]:
    contexts = getattr(replicas[0], "_replication_contexts", None) if replicas else None
    if not contexts:
        return list(replicas)
    return [_AbortSiblingsOnError(replica, i, contexts) for i, replica in enumerate(replicas)]


class ReplicationCallbackDataParallel(nn.DataParallel):
    """``nn.DataParallel`` that runs the replication callback after each replicate.

    After the module is copied onto the devices, ``__data_parallel_replicate__(ctx, copy_id)`` is called on
    every sub-module that defines it (see :func:`exec_data_parallel_replication_callback`), so that, e.g.,
    :class:`~distsync.DistSyncBatchNorm` copies synchronize their statistics across devices. If one replica
    raises in forward, the others are released and raise too. Without CUDA devices it is the plain module,
    like ``nn.DataParallel``.

    This is a migration aid for single-process multi-GPU code; prefer torchrun + ``DistributedDataParallel``.

    Args:
        module: module to be parallelized
        device_ids: CUDA devices. Default: all devices
        output_device: device of the gathered output. Default: ``device_ids[0]``
        dim: dimension the inputs are scattered along. Default: 0

    Examples::

        >>> sync_bn = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False)
        >>> sync_bn = ReplicationCallbackDataParallel(sync_bn, device_ids=[0, 1])
        >>> # sync_bn.__data_parallel_replicate__ will be invoked.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0) -> None:
        super().__init__(module, device_ids, output_device, dim)

    def replicate(self, module: nn.Module, device_ids):
        return _with_callback(super().replicate(module, device_ids))

    def parallel_apply(self, replicas, inputs, kwargs):
        return super().parallel_apply(_guarded(replicas), inputs, kwargs)


DataParallelWithCallback = ReplicationCallbackDataParallel  # Synchronized-BatchNorm's name


def patch_replication_callback(data_parallel: nn.DataParallel) -> None:
    """Monkey-patch an existing ``nn.DataParallel`` (or subclass) object to run the replication callback.

    Useful with a customized DataParallel implementation. The patch is on the object; a patched object
    does not pickle (save ``data_parallel.module`` instead, or use :class:`ReplicationCallbackDataParallel`).

    Examples::

        >>> sync_bn = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False)
        >>> sync_bn = DataParallel(sync_bn, device_ids=[0, 1])
        >>> patch_replication_callback(sync_bn)
        >>> # this is equivalent to
        >>> sync_bn = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False)
        >>> sync_bn = ReplicationCallbackDataParallel(sync_bn, device_ids=[0, 1])
    """
    if not isinstance(data_parallel, nn.DataParallel):
        raise TypeError(f"expected an nn.DataParallel, got {type(data_parallel).__name__}")
    if isinstance(data_parallel, ReplicationCallbackDataParallel) or getattr(
        data_parallel, "_replication_callback_patched", False
    ):
        return
    old_replicate = data_parallel.replicate
    old_parallel_apply = data_parallel.parallel_apply

    @functools.wraps(old_replicate)
    def new_replicate(module, device_ids):
        return _with_callback(old_replicate(module, device_ids))

    @functools.wraps(old_parallel_apply)
    def new_parallel_apply(replicas, inputs, kwargs):
        return old_parallel_apply(_guarded(replicas), inputs, kwargs)

    data_parallel.replicate = new_replicate
    data_parallel.parallel_apply = new_parallel_apply
    data_parallel._replication_callback_patched = True
