"""A user's script for tests/test_exit.py, started once per rank: it ends as timm's train.py does.

``python ddp_exit_script.py OUT_DIR ENDINGS DESTROY`` joins the world with ``distsync.init_distributed()``,
trains a DDP model with synced BN on a DataLoader with a worker process, and lets the model go (with
``destroy_process_group()`` before it when DESTROY is 1) while a worker thread of the gloo group needs the
GIL: until distsync kept the group alive, the model's ``Reducer`` then joined that thread holding the GIL,
every time. ENDINGS gives each rank's way out, by rank: ``exit0`` (the end of the script), ``exit3``
(``sys.exit(3)``) or ``raise`` (an uncaught exception). Each rank writes to OUT_DIR the pid of its loader's
worker and, from an exit handler, a log line.
"""

import atexit
import functools
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before the group exists, as in most scripts (see below)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distsync

# Imported after the group exists, torch.distributed.nn's functions would hold the group in their default
# arguments, and the model would never be the one to free it.

payload = torch.ones(3)  # held to the end: freeing the finished collective needs no GIL at the exit


def record_worker(out_dir: str, rank: int, worker_id: int) -> None:
    with open(os.path.join(out_dir, f"worker.{rank}.{worker_id}"), "w") as file:
        file.write(str(os.getpid()))


def slow_callback(future: torch.futures.Future) -> torch.Tensor:
    """Runs on the gloo group's worker thread: sleeps without the GIL, then needs it back to return."""
    time.sleep(0.5)
    return future.value()


def train(out_dir: str, rank: int, destroy: bool) -> tuple[DataLoader, torch.futures.Future]:
    distsync.init_distributed()
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model = nn.parallel.DistributedDataParallel(distsync.convert_sync_batchnorm(model))
    data = TensorDataset(torch.randn(16, 4))
    loader = DataLoader(
        data,
        batch_size=4,
        num_workers=1,
        persistent_workers=True,  # alive at the exit
        worker_init_fn=functools.partial(record_worker, out_dir, rank),
    )
    for (inputs,) in loader:
        model(inputs).sum().backward()
    pending = dist.all_reduce(payload, async_op=True).get_future().then(slow_callback)
    time.sleep(0.1)  # the callback now sleeps on the group's thread
    if destroy:
        dist.destroy_process_group()
    return loader, pending  # the DDP model goes here, and with it the group unless something else holds it


def main() -> None:
    out_dir, endings, destroy = sys.argv[1], sys.argv[2].split(","), sys.argv[3] == "1"
    rank = int(os.environ["RANK"])
    logging.basicConfig(filename=os.path.join(out_dir, f"log.{rank}"), level=logging.INFO)
    atexit.register(logging.getLogger("user").info, "exit handler ran")
    loader, pending = train(out_dir, rank, destroy)
    pending.wait()
    print(f"rank {rank} trained", end="")  # left in the buffer: the exit must flush it
    if endings[rank] == "exit3":
        sys.exit(3)
    if endings[rank] == "raise":
        raise RuntimeError(f"rank {rank} fails after training")


if __name__ == "__main__":
    main()
