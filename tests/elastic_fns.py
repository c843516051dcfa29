"""Module-level functions for distsync.launch tests (workers import them by name)."""

from __future__ import annotations

import os
import time


def rank_and_config(cfg):
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg


def fail_on_rank_one(cfg):
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one refuses")
    return "fine"


class HangsOnTeardown:
    """Blocks forever when freed: what a gloo group freed at the wrong moment does (pytorch#190489)."""

    def __del__(self, sleep=time.sleep):  # bound now: module globals may be gone at teardown
        sleep(3600)


_kept = []


def keep_until_exit(cfg):
    """Succeeds, leaving an object that only interpreter teardown would free."""
    _kept.append(HangsOnTeardown())
    return int(os.environ["RANK"])


def fail_holding(cfg):
    """Fails while a frame of the traceback holds an object whose release blocks."""
    held = HangsOnTeardown()  # noqa: F841
    raise ValueError(f"rank {os.environ['RANK']} fails")


def launch_and_print(name):
    """Launch ``name`` on 2 ranks from a subprocess of the tests, printing its result or its error."""
    import distsync
    from distsync.elastic import LaunchError

    try:
        print("result", distsync.launch(globals()[name], None, nproc_per_node=2))
    except LaunchError as error:
        print("failed", sorted(error.failures))


def flush_at_exit(path):
    """Registers an exit handler, as loggers that flush at exit do; it must still run."""
    import atexit

    atexit.register(lambda: open(f"{path}.{os.environ['RANK']}", "w").close())
    return "registered"
