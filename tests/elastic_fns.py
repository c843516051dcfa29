"""Module-level functions for the tests of distsync.launch and the lifeline (workers import them by name)."""

from __future__ import annotations

import os
import sys
import time


def rank_and_config(cfg):
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg


def imported_before_the_worker(cfg):
    """Whether the modules named in ``cfg`` were imported in another process (the fork server) than this
    worker: each records the pid that imported it."""
    import importlib

    return [importlib.import_module(name).IMPORTED_BY != os.getpid() for name in cfg]


def modules_at_start(cfg):
    """Which of the modules named in ``cfg`` this worker has before it imports anything itself."""
    return [name in sys.modules for name in cfg]


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


def launch_and_print(name, cfg=None, **options):
    """Launch ``name`` (on 2 ranks unless told) from a subprocess of the tests; print its result or error."""
    import distsync
    from distsync.launching.elastic import LaunchError

    options.setdefault("nproc_per_node", 2)
    try:
        print("result", distsync.launch(globals()[name], cfg, **options))
    except LaunchError as error:
        print("failed", sorted(error.failures), error)


def end_as(ends):
    """Rank ``r`` ends as ``ends[r]`` says, without returning (``{"how": "sys.exit", "code": 0}``, ...);
    the other ranks return."""
    rank = int(os.environ["RANK"])
    if rank in ends:
        how = ends[rank]["how"]
        if how == "os._exit":
            os._exit(ends[rank].get("code", 0))
        elif how == "signal":
            os.kill(os.getpid(), ends[rank]["signal"])
            time.sleep(60)
        elif how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        elif "code" in ends[rank]:
            sys.exit(ends[rank]["code"])
        else:
            sys.exit()
    return f"rank {rank} returned"


def arm_lifeline_and_wait(conn, watchdog_only):
    """A multiprocessing child: die with the process that started it, say so, then wait to be killed."""
    from distsync.launching import lifeline

    if watchdog_only:
        lifeline._PR_SET_PDEATHSIG = 0  # an invalid prctl option: the watchdog thread alone
    lifeline.die_with_parent(poll_interval=0.2)
    conn.send(os.getpid())
    time.sleep(120)


def start_armed_child(start_method, watchdog_only):
    """In a parent process: start an armed child by ``start_method``, print its pid, then wait."""
    import multiprocessing

    context = multiprocessing.get_context(start_method)
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=arm_lifeline_and_wait, args=(sender, watchdog_only))
    child.start()
    print(receiver.recv() if receiver.poll(60) else "not armed", flush=True)
    time.sleep(120)


def put_rank(queue):
    """Reports through a multiprocessing queue handed over as the config."""
    queue.put(int(os.environ["RANK"]))
    return "put"


class PickledSlowly:
    """Pickled only after a second: ``multiprocessing.Queue.put`` leaves the pickling to its feeder thread,
    so the rank's function has returned well before the queue has sent it. Arrives as the int."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self):
        time.sleep(1.0)
        return int, (self.value,)


def put_rank_pickled_slowly(queue):
    """Puts its rank on the queue and returns at once, the rank still to be pickled and sent."""
    queue.put(PickledSlowly(int(os.environ["RANK"])))
    return "put"


def flush_at_exit(path):
    """Registers an exit handler, as loggers that flush at exit do; it must still run."""
    import atexit

    atexit.register(lambda: open(f"{path}.{os.environ['RANK']}", "w").close())
    return "registered"


def devices_seen(cfg):
    """What this rank was confined to: its CUDA_VISIBLE_DEVICES, its cores and torch's threads."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    return int(os.environ["RANK"]), os.environ.get("CUDA_VISIBLE_DEVICES"), cores, torch.get_num_threads()


def all_ranks_devices(cfg):
    """Every rank's :func:`devices_seen`, gathered on rank 0 through the world's store-backed group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, devices_seen(cfg))
    dist.destroy_process_group()
    return seen


def launches_its_own(nproc_per_node):
    """A task that calls distsync.launch itself, asking for ``nproc_per_node`` ranks (an app's main)."""
    import distsync

    return distsync.launch(rank_and_config, "inner", nproc_per_node=nproc_per_node)


def _write_pid(path):
    """This process's pid into ``path``, whole or not at all (a test polls for it)."""
    with open(f"{path}.tmp", "w") as file:
        file.write(str(os.getpid()))
    os.replace(f"{path}.tmp", path)


def _record_pid(path, worker_id):
    """A DataLoader's ``worker_init_fn`` (through ``functools.partial``): its pid into ``path.<id>``."""
    _write_pid(f"{path}.{worker_id}")


def train_on_loader_workers(out_dir):
    """Trains until killed, as a rank of a real job does: a gloo all-reduce per batch of a DataLoader with two
    persistent workers, forked by the rank's own fork server (multiprocessing's default in a forkserver rank).
    Writes ``rank.<r>`` (its pid) once its workers have delivered a batch, each worker ``worker.<r>.<id>``."""
    import functools

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(
        TensorDataset(torch.randn(64, 4)),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=functools.partial(_record_pid, os.path.join(out_dir, f"worker.{rank}")),
    )
    while True:
        for (inputs,) in loader:
            dist.all_reduce(inputs.sum().reshape(1))
            if not os.path.exists(os.path.join(out_dir, f"rank.{rank}")):
                _write_pid(os.path.join(out_dir, f"rank.{rank}"))
            time.sleep(0.05)
