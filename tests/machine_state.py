"""One line on what the machine has left, printed with a failure as it happens.

A run that fails because the machine ran out of something (disk, memory, processes) fails everywhere at once,
and a run cut off by CI's time limit never reaches pytest's summary: the line says which, while it happens.
"""

from __future__ import annotations

import os
import shutil
import tempfile


def _mem_available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def describe() -> str:
    tmp = tempfile.gettempdir()
    parts = [f"free disk {shutil.disk_usage(tmp).free / 2**30:.1f} GiB in {tmp}"]
    if (memory := _mem_available_gib()) is not None:
        parts.append(f"memory available {memory:.1f} GiB")
    if hasattr(os, "getloadavg"):
        parts.append(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if os.path.isdir("/proc"):
        processes = sum(name.isdigit() for name in os.listdir("/proc"))
        parts.append(f"{processes} processes")
    return ", ".join(parts)
