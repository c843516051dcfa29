"""A Hydra app whose config is a dataclass stored in the ConfigStore from ``__main__``, for the tests.

Its task runs ``work`` on every rank: through ``distsync.launch`` (``face=launch``), or as it is, when the
``hydra/launcher=torchrun`` plugin already made it a rank (``face=task``). Every rank logs a DEBUG and an
INFO line and writes ``rank<N>.txt`` in the job's directory; ``end_on=N`` makes rank N end with
``sys.exit()``, without a result. The task writes the value it got back to ``result.txt`` (rank 0's task,
under the plugin).
"""

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig

import distsync

log = logging.getLogger("structured_app")


@dataclass
class Config:
    nproc: int = 2
    face: str = "launch"
    end_on: int = -1
    value: int = 1


ConfigStore.instance().store(name="config", node=Config)


def work(cfg: Config) -> int:
    rank = int(os.environ.get("RANK", "0"))
    log.debug(f"debug line of rank {rank}")
    log.info(f"info line of rank {rank}")
    Path(HydraConfig.get().runtime.output_dir, f"rank{rank}.txt").write_text(str(cfg.value))
    if rank == cfg.end_on:
        sys.exit()
    return cfg.value * 10 + rank


@hydra.main(version_base="1.3", config_name="config")
def main(cfg: Config) -> int:
    result = work(cfg) if cfg.face == "task" else distsync.launch(work, cfg, nproc_per_node=cfg.nproc)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(HydraConfig.get().runtime.output_dir, "result.txt").write_text(str(result))
    return result


if __name__ == "__main__":
    main()
