"""``distsync.launch(fn, cfg, nproc_per_node=None)``: a world whose size ``fn`` itself decides.

A launcher that runs whatever task it is given as a world (``hydra/launcher=torchrun`` without
``hydra.launcher.nproc_per_node``) cannot know how many ranks the task wants: an app says it in its own
call, ``distsync.launch(train, cfg, nproc_per_node=cfg.nproc_per_node)``, which inside a world runs
``train`` in place. So such a launch starts a world of one rank, marked as sized by its function; if the
function's own launch asks for another size there, it does not run in place: it raises
:class:`WorldSizeRequest`, which the rank returns as its result, and the launch starts the world again at
that size (unmarked: the app's launch then runs in place), before the app did anything else. A function
that never asks keeps its one rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["WorldSizeRequest", "ask_in_place", "sized_by_fn"]

SIZED_BY_FN = "DISTSYNC_WORLD_SIZED_BY_FN"  # in the workers' environment: this world's size is fn's to ask
T = TypeVar("T")


class WorldSizeRequest(BaseException):  # noqa: N818  not an error: a request, out of the user's handlers
    """Raised by ``distsync.launch(nproc_per_node=N)`` in place, in a one-rank world that its function
    sizes: start the world again with ``nproc_per_node`` ranks. Not an ``Exception``, so that the app's own
    ``except Exception`` does not take it for a failure."""

    def __init__(self, nproc_per_node: int | str) -> None:
        super().__init__(nproc_per_node)
        self.nproc_per_node = nproc_per_node


def ask_in_place(nproc_per_node: int | str | None) -> None:
    """In a worker, where ``distsync.launch`` runs its function in place: raise :class:`WorldSizeRequest`
    if this is a one-rank world its function sizes and ``nproc_per_node`` asks for another size."""
    if nproc_per_node is None or os.environ.get(SIZED_BY_FN) != "1":
        return
    if os.environ.get("WORLD_SIZE") != "1" or str(nproc_per_node) == "1":
        return
    raise WorldSizeRequest(nproc_per_node)


def sized_by_fn(start: Callable[[int | str], T]) -> T:
    """``start(1)`` in a world marked as sized by its function, then ``start(n)`` if the function asked
    for ``n`` ranks there; the value of the last."""
    with _marked():
        value = start(1)
    if not isinstance(value, WorldSizeRequest):
        return value
    try:
        return start(value.nproc_per_node)
    except ValueError as error:  # more ranks than the devices this launch was given
        raise ValueError(
            f"{error}: the function's own distsync.launch asks for nproc_per_node={value.nproc_per_node}; "
            "give this launch that many devices, or its size (hydra.launcher.nproc_per_node)"
        ) from None


@contextlib.contextmanager
def _marked() -> Iterator[None]:
    """The mark in this process's environment while the world starts (each worker gets the environment
    of its launch)."""
    before: Any = os.environ.get(SIZED_BY_FN)
    os.environ[SIZED_BY_FN] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SIZED_BY_FN, None)
        else:
            os.environ[SIZED_BY_FN] = before
