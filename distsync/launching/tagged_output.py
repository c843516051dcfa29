"""The console lines of jobs that run at once, each prefixed with its job's tag (``[job 2] ...``).

A packed sweep runs several jobs side by side, and their workers all write to the one console. Each job
process (and every worker it starts, which inherit its standard streams) writes into pipes of its own;
the launcher copies what comes out, line by line, to its own stdout and stderr, each line behind the
job's tag. A partial line waits for its end, or for the job's last output, so lines never interleave.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

__all__ = ["TaggedOutput"]

_CHUNK = 65536


class TaggedOutput:
    """One job's stdout and stderr: pipes made in the launcher before the job process is forked.

    In the job process, :meth:`become_job_output` puts the pipes in place of its standard streams. In the
    launcher, :meth:`forked` closes the job's ends, :meth:`fds` are what to wait on, and :meth:`relay`
    copies what one of them has; once every writer (the job process and its workers) has closed it, the
    fd reaches its end and is closed here.
    """

    def __init__(self, tag: str) -> None:
        self.tag = tag
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        self._job_ends = (out_write, err_write)
        self._targets: dict[int, TextIO] = {out_read: sys.stdout, err_read: sys.stderr}
        self._partial: dict[int, bytes] = {out_read: b"", err_read: b""}

    def become_job_output(self) -> None:
        """In the job process: its fds 1 and 2 are the pipes (inherited by the workers it starts)."""
        for fd in self._targets:
            os.close(fd)
        for fd, standard, name in zip(self._job_ends, (1, 2), ("stdout", "stderr"), strict=True):
            os.dup2(fd, standard)
            os.close(fd)
            if _fileno(getattr(sys, name)) != standard:  # Python's stream writes elsewhere (a capture)
                setattr(sys, name, open(standard, "w", buffering=1, closefd=False, errors="backslashreplace"))

    def forked(self) -> None:
        """In the launcher, once the job process exists: only the job writes into its pipes."""
        for fd in self._job_ends:
            os.close(fd)

    def fds(self) -> list[int]:
        """The pipes not yet at their end."""
        return list(self._targets)

    def relay(self, fd: int) -> None:
        """Copy the whole lines ``fd`` has now (a read that would not block: it was ready) to this
        process's stream, each behind the tag; at its end, the rest, and close it."""
        data = os.read(fd, _CHUNK)
        target, text = self._targets[fd], self._partial[fd] + data
        if data:
            *lines, self._partial[fd] = text.split(b"\n")
        else:
            lines = [text] if text else []
            self._close(fd)
        if lines:
            self._write(target, lines)

    def close(self) -> None:
        """Give up on pipes a stray process still holds: write what came, close them."""
        for fd in list(self._targets):
            target = self._targets[fd]
            if self._partial[fd]:
                self._write(target, [self._partial[fd]])
            self._close(fd)

    def _write(self, target: TextIO, lines: list[bytes]) -> None:
        text = "".join(f"{self.tag}{line.decode(errors='replace')}\n" for line in lines)
        target.write(text)
        target.flush()

    def _close(self, fd: int) -> None:
        os.close(fd)
        self._targets.pop(fd, None)
        self._partial.pop(fd, None)


def _fileno(stream: TextIO | None) -> int | None:
    try:
        return stream.fileno() if stream is not None else None
    except (AttributeError, OSError, ValueError):
        return None
