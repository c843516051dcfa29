"""Which layer, direction and call a sync payload belongs to, the same on every rank.

A layer's identity is its module path (``layer1.0.bn1``, found at its first sync in the outermost module
being called that holds it), its width and how many deep copies away from a built or loaded layer it is,
hashed to a bounded integer. It does not depend on how many layers each process built, nor on whether a
process built its model or unpickled it; a deep copy (an EMA teacher) is never taken for its original.
Every call adds ``[layer, direction, call]`` and their squares to the payload tail: after a SUM over W
participants, ``(sum t)^2 == W sum(t^2)`` for each field iff all sent the same value. The values are kept
below a modulus ``m`` with ``3 (W m)^2 < 2^53``, so float64 holds every term exactly.

Tails live on the device in small per-layer tables (a block of consecutive calls per direction), so a call
selects its tail as a view: no host-to-device copy per call.
"""

from __future__ import annotations

import sys
import weakref
import zlib
from typing import NamedTuple

import torch
from torch import Tensor, nn

# Tail slots: [count | failed | layer, direction, call | their squares | guard].
COUNT, FAILED, LAYER, DIRECTION, CALL = 0, 1, 2, 3, 4
IDENTITY, SQUARES, GUARD = slice(2, 5), slice(5, 8), 8
TAIL = 9
FORWARD, BACKWARD = 0, 1
_DIRECTIONS = ("forward", "backward")
_BLOCK = 64  # calls per tail table
_EXACT = 2**53 / 3  # (W m)^2 must stay below this
MAX_WORLD_SIZE = int(_EXACT**0.5) // _BLOCK


def call_modulus(world_size: int) -> int:
    """Largest multiple of the table block (at most 2^20) with ``3 (W m)^2 < 2^53``."""
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


# Every module's latest parent and its name there, recorded as modules are registered, so that a layer
# constructed directly inside a model can find its own path when it first syncs.
_parents: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, str]] = weakref.WeakKeyDictionary()


def _record_parent(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    if child is not None:
        _parents[child] = (weakref.ref(parent), name)


nn.modules.module.register_module_module_registration_hook(_record_parent)


def module_path(module: nn.Module) -> str:
    """Dotted path of ``module`` from the outermost module that registered it ('' for a module on its own).

    Registration records exist for modules built in this process; unpickled or deep-copied trees have none,
    which is why a syncing layer asks :func:`layer_path` instead.
    """
    names, seen = [], {id(module)}
    while module in _parents:
        parent_ref, name = _parents[module]
        parent = parent_ref()
        if parent is None or id(parent) in seen or getattr(parent, "_modules", {}).get(name) is not module:
            break
        names.append(name)
        seen.add(id(parent))
        module = parent
    return ".".join(reversed(names))


def _calling_modules() -> list[nn.Module]:
    """Modules whose forward is running in this thread, outermost first (from their frames' ``self``)."""
    modules, seen = [], set()
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) not in seen:
            seen.add(id(owner))
            modules.append(owner)
        frame = frame.f_back
    return modules[::-1]


def layer_path(layer: nn.Module) -> str:
    """Dotted path of ``layer`` in the outermost module being called that holds it.

    The same on every rank that runs the same model, however each process got its copy (built, converted,
    ``torch.load``-ed whole, deep-copied) and whatever else it holds it in. A layer called on its own falls
    back to its registration path.
    """
    for root in _calling_modules():
        if root is layer:
            break
        for name, module in root.named_modules(remove_duplicate=False):
            if module is layer:
                return name
    return module_path(layer)


def layer_hash(path: str, num_features: int, copies: int = 0) -> int:
    return zlib.crc32(f"{path}:{num_features}:{copies}".encode())


class SyncState:
    """A synchronized layer's identity, call counts and device-side tails, plus its merge shift.

    Copies start with fresh counts and no cached tensors. A deep copy also counts one more generation
    (``copies``), so a teacher copied from a student never passes for it in the desync check; an unpickled
    layer counts as built (``copies == 0``), so a model loaded whole on one rank matches the model built on
    another.
    """

    def __init__(self, layer_name: str = "", copies: int = 0) -> None:
        self.layer_name = layer_name  # the module path once known
        self.copies = copies  # deep copies between this layer and one built or unpickled
        self.identity: int | None = None
        self.calls = [0, 0]
        self.shift: Tensor | None = None  # previous global mean (float64), shared by every rank
        self._tables: dict = {}
        self.scratch: dict = {}  # small per-device tensors reused call after call

    def __deepcopy__(self, memo) -> SyncState:
        return SyncState(self.layer_name, self.copies + 1)

    def __getstate__(self) -> dict:
        return {"layer_name": self.layer_name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["layer_name"])

    def fresh_copy(self) -> SyncState:
        """Same identity and counts, own tables (for a replica that syncs on its own)."""
        copy = SyncState(self.layer_name, self.copies)
        copy.identity, copy.calls = self.identity, list(self.calls)
        return copy

    def next_tag(self, direction: int) -> CallTag:
        call = self.calls[direction]
        self.calls[direction] = call + 1
        return CallTag(self.identity or 0, direction, call, self.layer_name or "synchronized BN layer")

    def tail(self, tag: CallTag, world_size: int, first: bool, device: torch.device) -> Tensor:
        """The tail row of call ``tag`` (a view into a device table; count slot 1 in forward, else 0)."""
        modulus = call_modulus(world_size)
        call = tag.call % modulus
        key = (tag.direction, world_size, first, device)
        block, table = self._tables.get(key, (None, None))
        if block != call // _BLOCK:
            block = call // _BLOCK
            layer = tag.layer_id % modulus
            table = _tail_table(layer, tag.direction, block * _BLOCK, world_size, first, device)
            self._tables[key] = (block, table)
        return table[call % _BLOCK]


def _tail_table(layer: int, direction: int, start: int, world_size: int, first: bool, device) -> Tensor:
    """Tails of ``_BLOCK`` consecutive calls, built on the device from host scalars (no copy)."""
    calls = torch.arange(start, start + _BLOCK, dtype=torch.float64, device=device)
    constant = calls.new_zeros(()).expand(_BLOCK)
    squares = calls * calls
    fixed_squares = float(layer * layer + direction * direction)
    guard = torch.add(squares, fixed_squares).mul_(-world_size).add_(1.0 if first else 0.0)
    columns = [
        constant + (1.0 if direction == FORWARD else 0.0),
        constant,
        constant + float(layer),
        constant + float(direction),
        calls,
        constant + float(layer * layer),
        constant + float(direction * direction),
        squares,
        guard,
    ]
    return torch.stack(columns, dim=1)


def failed_row(row: Tensor) -> Tensor:
    """``row`` for a participant that rejected its input: failed set, guard lowered, count 0."""
    failed = row.clone()
    failed[COUNT] = 0.0
    failed[FAILED] = 1.0
    failed[GUARD] -= 1.0
    return failed
