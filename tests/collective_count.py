"""Counting the synchronized layers' all-reduces in a test (the process group transport's calls)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from distsync._syncbn import payload as transport


@contextlib.contextmanager
def counted_all_reduces() -> Iterator[list[int]]:
    """While entered, each all-reduce of a synchronized layer over a process group appends its payload's
    size to the list yielded."""
    calls: list[int] = []
    original = transport.ProcessGroupReducer.all_reduce

    @functools.wraps(original)
    def counted(self, payload):
        calls.append(payload.numel())
        return original(self, payload)

    transport.ProcessGroupReducer.all_reduce = counted
    try:
        yield calls
    finally:
        transport.ProcessGroupReducer.all_reduce = original
