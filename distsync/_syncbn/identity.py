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

Every call adds ``[layer (4 digits), direction, call]`` and their squares to the payload tail: after a
SUM over W participants, ``(sum t)^2 == W sum(t^2)`` for each field iff all sent the same value. The values
are kept below a modulus ``m`` with ``6 (W m)^2 < 2^53``, so float64 holds every term exactly; the layer
hash is written as four base-``m`` digits (all 64 bits for ``m >= 2^16``, i.e. up to 590 ranks).

Tails live on the device in small per-layer tables (a block of consecutive calls per direction), so a call
selects its tail as a view: no host-to-device copy per call.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn

from distsync import _torch_compat

# Tail slots: [count | failed | layer digits (4), direction, call | their squares | guard].
COUNT, FAILED = 0, 1
LAYER_DIGITS = 4
LAYER, DIRECTION, CALL = 2, 2 + LAYER_DIGITS, 3 + LAYER_DIGITS
_FIELDS = LAYER_DIGITS + 2
IDENTITY, SQUARES = slice(2, 2 + _FIELDS), slice(2 + _FIELDS, 2 + 2 * _FIELDS)
GUARD = 2 + 2 * _FIELDS
TAIL = GUARD + 1
FORWARD, BACKWARD = 0, 1
_DIRECTIONS = ("forward", "backward")
_BLOCK = 64  # calls per tail table
_EXACT = 2**53 / _FIELDS  # (W m)^2 must stay below this
MAX_WORLD_SIZE = int(_EXACT**0.5) // _BLOCK


MIN_PAYLOAD = 256


def payload_size(num_channels: int) -> int:
    """Length of a sync payload for ``num_channels`` channels: ``2C + TAIL`` rounded up to its size class,
    a power of two of at least ``MIN_PAYLOAD`` (see :mod:`distsync._syncbn.moments`)."""
    return max(MIN_PAYLOAD, 1 << (2 * num_channels + TAIL - 1).bit_length())


@functools.cache
def call_modulus(world_size: int) -> int:
    """Largest multiple of the table block (at most 2^20) with ``6 (W m)^2 < 2^53``."""
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"distsync's exact desync check supports at most {MAX_WORLD_SIZE} participants per "
            f"synchronized layer, got {world_size}; sync within smaller process groups"
        )
    bound = int((_EXACT**0.5) / world_size)
    return min(1 << 20, bound - bound % _BLOCK)


class CallTag(NamedTuple):
    """Which layer, direction and call of that layer a payload belongs to (identical on every rank)."""

    layer_id: int
    direction: int
    call: int
    layer_name: str

    def describe(self) -> str:
        return f"{self.layer_name}, {_DIRECTIONS[self.direction]} call #{self.call}"


# Slots through which a wrapper holds the module it wraps: not part of a path.
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


_BUILT = itertools.count()  # synchronized layers built in this process, in order


class SyncState:
    """A synchronized layer's identity, call counts and device-side tails, plus its merge shift.

    Copies start with fresh counts and no cached tensors, and keep the path stamp and explicit name. A
    deep copy also counts one more generation (``copies``), so a teacher copied from a student never
    passes for it in the desync check; an unpickled layer counts as built (``copies == 0``), so a model
    loaded whole on one rank matches the model built on another.
    """

    def __init__(
        self,
        layer_name: str = "",
        copies: int = 0,
        path: str | None = None,
        name: str | None = None,
        built: int | None = None,
    ) -> None:
        self.layer_name = layer_name  # for messages, once the identity is known
        self.copies = copies  # deep copies between this layer and one built or unpickled
        self.path = path  # stamped by conversion or at the first call; kept by pickles and copies
        self.name = name  # explicit name (name_layers), preferred to any path
        self.built = next(_BUILT) if built is None else built  # the name of a layer with no path
        self.identity: int | None = None
        self.calls = [0, 0]
        self.shift: Tensor | None = None  # merge shift (float64), shared by every rank
        self.shift_ref: Tensor | None = None  # variance of the call the shift was judged against
        self._tables: dict = {}
        self.scratch: dict = {}  # small per-device tensors reused call after call
        self.join = None  # the reducer of the Join the layer is in (distsync.join), never copied
        self.transport = None  # (process group, its reducer) of the last call, never copied

    def __deepcopy__(self, memo) -> SyncState:
        return SyncState(self.layer_name, self.copies + 1, self.path, self.name, self.built)

    def __getstate__(self) -> dict:
        return {"layer_name": self.layer_name, "path": self.path, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.get("layer_name", ""), 0, state.get("path"), state.get("name"))

    def fresh_copy(self) -> SyncState:
        """Same identity and counts, own tables (for a replica that syncs on its own)."""
        copy = SyncState(self.layer_name, self.copies, self.path, self.name, self.built)
        copy.identity, copy.calls = self.identity, list(self.calls)
        return copy

    def resolve(self, layer: nn.Module, num_features: int) -> None:
        """Fix the identity of ``layer`` (at its first synchronized call)."""
        path = layer_path(layer)
        self.identity = layer_hash(path, num_features, self.copies)
        kind = type(layer).__name__
        self.layer_name = f"'{path}' ({kind})" if path else kind

    def next_tag(self, direction: int) -> CallTag:
        call = self.calls[direction]
        self.calls[direction] = call + 1
        return CallTag(self.identity or 0, direction, call, self.layer_name or "synchronized BN layer")

    def tail(self, tag: CallTag, world_size: int, first: bool, device: torch.device, width: int) -> Tensor:
        """The end of call ``tag``'s payload for ``width`` channels: the zeros that pad it to its size class,
        then the tail (count slot 1 in forward, else 0). A view into a device table: no copy per call."""
        modulus = call_modulus(world_size)
        call = tag.call % modulus
        key = (tag.direction, world_size, first, device, width)
        block, table = self._tables.get(key, (None, None))
        if block != call // _BLOCK:
            block = call // _BLOCK
            digits = [(tag.layer_id // modulus**i) % modulus for i in range(LAYER_DIGITS)]
            table = _tail_table(digits, tag.direction, block * _BLOCK, world_size, first, device)
            pad = payload_size(width) - 2 * width - TAIL
            table = torch.cat([table.new_zeros(_BLOCK, pad), table], dim=1)
            self._tables[key] = (block, table)
        return table[call % _BLOCK]


def _tail_table(
    digits: list[int], direction: int, start: int, world_size: int, first: bool, device
) -> Tensor:
    """Tails of ``_BLOCK`` consecutive calls, built on the device from host scalars (no copy)."""
    calls = torch.arange(start, start + _BLOCK, dtype=torch.float64, device=device)
    constant = calls.new_zeros(()).expand(_BLOCK)
    squares = calls * calls
    fixed = [*digits, direction]
    fixed_squares = float(sum(v * v for v in fixed))
    guard = torch.add(squares, fixed_squares).mul_(-world_size).add_(1.0 if first else 0.0)
    columns = [
        constant + (1.0 if direction == FORWARD else 0.0),
        constant,
        *(constant + float(v) for v in fixed),
        calls,
        *(constant + float(v * v) for v in fixed),
        squares,
        guard,
    ]
    return torch.stack(columns, dim=1)


def failed_row(row: Tensor) -> Tensor:
    """``row`` for a participant that rejected its input: failed set, guard lowered, count 0."""
    failed = row.clone()
    tail = failed[failed.numel() - TAIL :]
    tail[COUNT] = 0.0
    tail[FAILED] = 1.0
    tail[GUARD] -= 1.0
    return failed
