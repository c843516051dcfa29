import collections
import warnings

import _vision
import leftover_processes
import machine_state
import pytest
import torch
from slurm_cluster import slurm_cluster  # noqa: F401  (the session's SLURM cluster, for test_slurm.py)

_vision.ensure_importable()  # torchvision's models importable beside the CPU torch (see _vision.py)
_WATCHING = leftover_processes.watch()  # orphans of the tests' processes become this process's children


def pytest_collection_modifyitems(config, items):
    _files_with_most_end_to_end_runs_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _files_with_most_end_to_end_runs_first(items):
    """Files ordered by how many of their tests are marked slow (the end-to-end runs), most first, each
    file's tests kept in order: a parallel run (``-n``, one file per process at a time) then starts the
    long files at once instead of leaving one of them to run alone at the end."""
    slow = collections.Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Whatever a test started and left running is killed when it ends, and named in a warning: it would
    otherwise slow every later test down to its timeout (see leftover_processes)."""
    if not _WATCHING:
        yield
        return
    before = leftover_processes.running_descendants()
    yield
    leaked = leftover_processes.kill_new(before)
    if leaked:
        listing = "\n".join(f"  {pid}: {cmd[:300]}" for pid, cmd in leaked.items())
        warnings.warn(f"killed {len(leaked)} process(es) the test left running:\n{listing}", stacklevel=1)


_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    """Say each failure as it happens, with what the machine has left: a run cut off by a time limit never
    prints pytest's summary, and a failure caused by the machine is told apart from one caused by the code."""
    if not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    reason = (
        crash.message.splitlines()[0][:300] if crash is not None and crash.message else "(see the summary)"
    )
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
    if terminal is not None:
        terminal.write("\n")  # off the line of progress marks
        terminal.write_line(f"FAILED {report.nodeid} ({report.when}): {reason} [{machine_state.describe()}]")
