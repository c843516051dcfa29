"""Which layer, direction and call a sync payload belongs to, the same on every rank.

A layer's identity is its module path from the root of the module tree that holds it (``layer1.0.bn1``),
its width and how many deep copies away from a built or loaded layer it is, hashed to 64 bits. The path is
stamped on the layer's sync state (which pickling and deep copies carry along), by the first of:

* :func:`name_layers`, an explicit name;
* :func:`distsync.convert_sync_batchnorm`, which names every synchronized layer under the module it
  converts by its path from there (layers already synchronized included);
* pickling: a model ``torch.load``-ed whole keeps the paths of the process that saved it;
* the first synchronized call of a layer that has none (built directly, never converted): the outermost
  module being called at that moment whose tree holds it, whose synchronized layers all get their paths
  from it at once (:func:`distsync._torch_compat.modules_being_called`, which reads the ``self`` of
  torch's own module-call frames and nothing of the caller's).

A layer with no path at its first call (called on its own, ``model[1](x)`` in a loop, on a model never
converted nor called whole, or held by no module) is named by when it was built: ``#k``, the k-th
synchronized layer built or unpickled in this process. Ranks that build their models in the same order
agree, and two such layers of one width always differ, so ranks calling them in different orders raise
rather than mix their statistics; ranks that build them in different orders get ``SyncMismatchError`` at
the first call, and name the layers with :func:`name_layers` (or convert the model, or call it whole
once). No heap is scanned for the module that holds a layer.

No frame is read here: the one place that reads frames is ``_torch_compat``.

Nothing global is registered: importing distsync changes nothing in how torch builds modules, and no
user module's ``__eq__`` or ``__hash__`` is ever called (layers are kept by ``id``).

The slots of wrappers (DDP's and DataParallel's ``module``, ``torch.compile``'s ``_orig_mod``, FSDP's and
checkpoint wrappers' inner module) are left out, so a wrapper on some ranks only changes nothing. Paths
are from the root, so ``model.encoder(x)`` and ``model.decoder(y)`` called directly are told apart.
Two separately converted models of one structure are indistinguishable by construction: name them with
:func:`name_layers` if ranks may call them in different orders.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from torch import nn

from distsync import _torch_compat
from distsync._syncbn.payload import SyncState

_WRAPPER_SLOTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def is_wrapper_slot(parent: nn.Module, name: str) -> bool:
    """Whether ``parent`` holds the module it wraps under ``name`` (left out of paths)."""
    if name in _WRAPPER_SLOTS:
        return True
    return name == "module" and isinstance(parent, (nn.DataParallel, nn.parallel.DistributedDataParallel))


def walk(root: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Every module under ``root`` (``root`` first, each once) with its path from ``root``, wrapper slots
    left out: ``named_modules`` without the wrappers' names, pre-order."""
    stack, seen = [(root, "")], {id(root)}
    while stack:
        module, path = stack.pop()
        yield module, path
        for name, child in reversed(module._modules.items()):
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                inner = path if is_wrapper_slot(module, name) else ".".join(filter(None, [path, name]))
                stack.append((child, inner))


def stamp_paths(root: nn.Module, only_missing: bool = False) -> bool:
    """Stamp every synchronized layer under ``root`` with its path from ``root`` (with ``only_missing``,
    those that have no path yet). Returns whether any layer was found."""
    found = False
    for module, path in walk(root):
        state = getattr(module, "_sync_state", None)
        if isinstance(state, SyncState):
            found = True
            if state.path != path and not (only_missing and state.path is not None):
                state.path = path
                state.identity = None  # resolved again at the next synchronized call
    return found


def _holds(root: nn.Module, layer: nn.Module) -> bool:
    return any(module is layer for module, _ in walk(root))


def layer_path(layer: nn.Module) -> str:
    """The path a synchronized layer is identified by: a name given with :func:`name_layers`, else the path
    stamped on it (by conversion, pickling or an earlier call), else its path from the outermost module
    being called now whose tree holds it (all unnamed layers under that module are stamped from it at
    once), else ``#k``, the order it was built in (see the module docstring)."""
    state = layer._sync_state
    if state.name is not None:
        return state.name
    if state.path is None:
        callers = _torch_compat.modules_being_called()
        root = next((m for m in callers if m is not layer and _holds(m, layer)), None)
        if root is None:
            return f"#{state.built}"  # not stamped: a later call under its model, or conversion, names it
        stamp_paths(root, only_missing=True)
    return state.path


def layer_hash(path: str, num_features: int, copies: int = 0) -> int:
    """64-bit identity of a layer (the same in every process: not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{path}:{num_features}:{copies}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def name_layers(module: nn.Module, name: str) -> nn.Module:
    """Name the synchronized layers of ``module`` ``name.<path in module>`` for the cross-rank desync check.

    Layers are told apart across ranks by their path from the root of their module tree. Two separately
    built models of the same structure (two students, a model and its re-built copy) have the same paths:
    if ranks may call them in different orders, name them, on every rank, before their first
    synchronized call::

        >>> distsync.name_layers(teacher, "teacher")
        >>> distsync.name_layers(student, "student")

    The names survive pickling and deep copies (a deep copy still counts as another layer). Returns
    ``module``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name_layers needs a non-empty string name, got {name!r}")
    for layer, path in walk(module):
        state = getattr(layer, "_sync_state", None)
        if isinstance(state, SyncState):
            state.name = f"{name}.{path}" if path else name
            state.identity = None  # resolved again at the next synchronized call
    return module


def resolve(layer: nn.Module, num_features: int) -> None:
    """Fix the identity of ``layer`` (at its first synchronized call): its path hashed with its width and
    copies, and the name its errors give."""
    state = layer._sync_state
    path = layer_path(layer)
    state.identity = layer_hash(path, num_features, state.copies)
    state.layer_name = f"'{path}' ({type(layer).__name__})" if path else type(layer).__name__
