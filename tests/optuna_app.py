"""A Hydra app for the distsync_optuna sweeper's tests (tests/test_optuna_sweeper.py).

Each trial sleeps ``steps`` steps of ``step_seconds``, reporting ``value + 1 / (step + 1)`` at each step and
stopping when the study's pruner says so; it returns ``value`` (with ``objectives=2``, ``[value, -value]``).
Every rank writes when its trial started and ended, at which step it stopped, its parent process and its
process group into ``<job dir>/rank<R>.json``. ``fail_when`` makes the trial fail when its ``x`` exceeds it;
``linger`` keeps the ranks other than 0 that many seconds after rank 0 returned (a world that ends late).
Under ``hydra/launcher=torchrun`` each trial is a world of its own.
"""

import json
import os
import time
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig

import distsync

ConfigStore.instance().store(
    name="config",
    node={
        "x": 0.0,
        "steps": 4,
        "step_seconds": 0.1,
        "fail_when": 1e9,
        "value_scale": 1.0,
        "objectives": 1,
        "linger": 0.0,
    },
)


@hydra.main(version_base="1.3", config_path=None, config_name="config")
def main(cfg) -> float:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        distsync.init_distributed()
    started = time.time()
    value = cfg.value_scale * float(cfg.x)
    stopped = None
    for step in range(int(cfg.steps)):
        time.sleep(cfg.step_seconds)
        distsync.report(step, value + 1.0 / (step + 1))
        if distsync.should_prune():
            stopped = step
            break
    rank = int(os.environ.get("RANK", "0"))
    record = {"start": started, "end": time.time(), "pruned_at": stopped, "x": float(cfg.x)}
    record.update(ppid=os.getppid(), pgid=os.getpgrp(), cores=sorted(os.sched_getaffinity(0)))
    (Path(HydraConfig.get().runtime.output_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    if float(cfg.x) > cfg.fail_when:
        raise RuntimeError(f"x={cfg.x} fails on purpose")
    if rank > 0:
        time.sleep(cfg.linger)
    return [value, -value] if cfg.objectives == 2 else value


if __name__ == "__main__":
    main()
