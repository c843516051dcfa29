"""A packed batch of jobs that wait to be stopped: run by tests/test_packing.py, which signals it.

python packing_script.py <dir>    # 4 jobs, 2 slots; job k writes <dir>/started-<k> (its pid) and waits
"""

import os
import sys
import time
from pathlib import Path

from distsync.launching.device_split import DeviceSet
from distsync.launching.packing import run_packed


def wait_for_a_signal(k: int, out: Path, slot: DeviceSet) -> int:
    pending = out / f".starting-{k}"  # renamed once written, so a reader never sees an empty file
    pending.write_text(str(os.getpid()))
    pending.rename(out / f"started-{k}")
    time.sleep(120)
    return k


if __name__ == "__main__":
    import functools

    out = Path(sys.argv[1])
    slots = [DeviceSet("cpu", (0,)), DeviceSet("cpu", (1,))]
    run_packed([functools.partial(wait_for_a_signal, k, out) for k in range(4)], slots)
