"""A Hydra app for the distsync_optuna sweeper's tests (tests/test_optuna_sweeper.py).

Each trial sleeps ``steps`` steps of ``step_seconds``, reporting ``value + 1 / (step + 1)`` at each step and
stopping when the study's pruner says so; it returns ``value`` (with ``objectives=2``, ``[value, -value]``).
Every rank writes when its trial started and ended, at which step it stopped, its parent process and its
process group into ``<job dir>/rank<R>.json``. ``fail_when`` makes the trial fail when its ``x`` exceeds it;
``linger`` keeps the ranks other than 0 that many seconds after rank 0 returned (a world that ends late).
Under ``hydra/launcher=torchrun`` each trial is a world of its own. Every rank also writes a line to
``<job dir>/started<R>.jsonl`` as it starts (its pid, the step it starts from) and, with
``checkpoint=true``, ``<job dir>/step<R>.txt`` after each step: a trial run again in its job dir goes on
after that step, as the packaged job resumes from its checkpoint.
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
        "checkpoint": False,
    },
)


@hydra.main(version_base="1.3", config_path=None, config_name="config")
def main(cfg) -> float:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        distsync.init_distributed()
    started = time.time()
    value = cfg.value_scale * float(cfg.x)
    stopped = None
    rank = int(os.environ.get("RANK", "0"))
    out = Path(HydraConfig.get().runtime.output_dir)
    saved = out / f"step{rank}.txt"
    pending = saved.with_suffix(".tmp")
    first = int(saved.read_text()) + 1 if cfg.checkpoint and saved.exists() else 0
    with open(out / f"started{rank}.jsonl", "a") as starts:  # one line per run of the trial in this dir
        starts.write(json.dumps({"pid": os.getpid(), "first_step": first, "time": started}) + "\n")
    for step in range(first, int(cfg.steps)):
        time.sleep(cfg.step_seconds)
        if cfg.checkpoint:  # whole or not at all, as a checkpoint is saved: a kill never leaves it empty
            pending.write_text(str(step))
            os.replace(pending, saved)
        distsync.report(step, value + 1.0 / (step + 1))
        if distsync.should_prune():
            stopped = step
            break
    record = {"start": started, "end": time.time(), "pruned_at": stopped, "x": float(cfg.x)}
    record.update(ppid=os.getppid(), pgid=os.getpgrp(), cores=sorted(os.sched_getaffinity(0)))
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if float(cfg.x) > cfg.fail_when:
        raise RuntimeError(f"x={cfg.x} fails on purpose")
    if rank > 0:
        time.sleep(cfg.linger)
    return [value, -value] if cfg.objectives == 2 else value


if __name__ == "__main__":
    main()
