"""How long a slot of a packed sweep stays free: from a job's last line to the first line of the next job
on its devices, and another revision of distsync to compare with, side by side in one run.

Each job is ``{"start": first line, "end": last line, "slot": its devices}`` (seconds since the epoch, as
the job's own lines say). The next job on a slot is the first that starts there after a job ended there;
a slot that no later job takes adds nothing.
"""

from __future__ import annotations

import os
import statistics
from datetime import datetime
from pathlib import Path

from _revisions import extract


def slot_gaps(jobs: list[dict]) -> list[float]:
    """Seconds from each job's end to the start of the next job on its slot."""
    gaps = []
    for job in jobs:
        later = [j["start"] for j in jobs if j["slot"] == job["slot"] and j["start"] >= job["end"]]
        if later:
            gaps.append(min(later) - job["end"])
    return gaps


def describe(gaps: list[float]) -> str:
    """``median (max)`` of ``gaps``, or a dash without any."""
    return f"{statistics.median(gaps):.2f} ({max(gaps):.2f})" if gaps else "-"


def log_time(line: str) -> float:
    """The time of a Hydra log line, ``[2026-11-28 04:23:40,364][...] ...``, in seconds since the epoch."""
    stamp = line[1 : line.index("]")]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def checkout_of(rev: str, into: Path) -> Path:
    """``distsync/`` and ``hydra_plugins/`` of git revision ``rev``, written under ``into``; the folder to
    put first on ``PYTHONPATH`` to run that revision (its plugins found first by Hydra's scan)."""
    return extract(rev, ["distsync", "hydra_plugins"], into)


def env_running(checkout: Path, **extra: str) -> dict[str, str]:
    """This environment, with ``checkout``'s distsync found first, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "DISTSYNC_TEST_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env
