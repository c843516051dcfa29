"""A Hydra app for the distsync_optuna sweeper's tests (tests/test_optuna_sweeper.py).

Each trial sleeps ``steps`` steps of ``step_seconds``, reporting ``value + 1 / (step + 1)`` at each step and
stopping when the study's pruner says so; it returns ``value``. Every rank writes when its trial started
and ended and at which step it stopped into ``<job dir>/rank<R>.json``. ``fail_when`` makes the trial fail
when its ``x`` exceeds it. Under ``hydra/launcher=torchrun`` each trial is a world of its own.
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
    name="config", node={"x": 0.0, "steps": 4, "step_seconds": 0.1, "fail_when": 1e9, "value_scale": 1.0}
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
    (Path(HydraConfig.get().runtime.output_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    if float(cfg.x) > cfg.fail_when:
        raise RuntimeError(f"x={cfg.x} fails on purpose")
    return value


if __name__ == "__main__":
    main()
