"""A stretch of training: the steps a rank takes between two points where every rank meets.

The one training loop (:meth:`distsync.train.trainer.Trainer.fit`) asks its batch source for stretches.
Within a stretch the job makes no collective of its own (the model's, DDP's and the synchronized layers',
still run), so its logs, evaluations and checkpoints wait for the stretch's end, where the ranks agree on
the step they reached. A map-style source (every rank the same number of batches) gives stretches of one
step each, and agreeing costs nothing; a stream (uneven batches per rank) gives one stretch per pass, run
under DDP's ``Join``, and the ranks agree at its end (:mod:`distsync.train.streaming`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

from torch import Tensor

__all__ = ["Stretch", "StretchSource", "one_step_stretches"]

Batch = tuple[Tensor, Tensor]


class Stretch(NamedTuple):
    """Steps to take under ``context``; each item of ``steps`` feeds one optimizer step its micro-batches."""

    context: contextlib.AbstractContextManager
    steps: Iterator[Iterator[Batch]]


class StretchSource(Protocol):
    """What the training loop needs of a batch source."""

    epoch: int

    def stretches(self, model: Any) -> Iterator[Stretch]:
        """Endless stretches; ``model`` is the module the steps call (DDP on several ranks)."""
        ...

    def agree(self, start: int, step: int, losses: list[tuple[int, Tensor]], keep: int) -> tuple[int, dict]:
        """At a stretch's end, begun at ``start``, this rank at ``step`` with its ``(step, loss)`` pairs:
        the step every rank is at now, and the loss to remember for each of the last ``keep`` steps."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def one_step_stretches(batches: Iterator[Batch]) -> Iterator[Stretch]:
    """Stretches of one step each over endless ``batches``; the step draws as many as it needs."""
    while True:
        yield Stretch(contextlib.nullcontext(), iter([batches]))
