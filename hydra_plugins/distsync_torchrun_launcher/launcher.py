"""``hydra/launcher=torchrun``: run every job of a Hydra sweep as its own torchrun world.

    python my_app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=4 lr=0.1,0.2

Each job's config is composed in this process, as Hydra's basic launcher does, and the task function then
runs on every rank of a world that :func:`distsync.launch` starts for the job: the config resolved once,
one run directory for all ranks, ``HydraConfig`` in the workers, rank 0's return value back to the sweeper.
A job whose workers fail is recorded as failed; the other jobs of the batch still run.
"""

# No ``from __future__ import annotations`` here: Hydra imports plugins outside ``sys.modules``, where
# dataclasses cannot resolve string annotations, and OmegaConf reads these types (hence ``Optional``).

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.errors import ConfigCompositionException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class TorchrunLauncherConf:
    """Options of :func:`distsync.launch`, named like torchrun's flags."""

    _target_: str = "hydra_plugins.distsync_torchrun_launcher.launcher.TorchrunLauncher"
    nproc_per_node: Any = 1  # an int, or "gpu" / "cpu" / "auto"
    nnodes: Any = 1  # N or "MIN:MAX"
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_id: str = ""  # with several nodes, job k of the sweep meets under "<rdzv_id>-<k>"
    rdzv_conf: dict[str, Any] = field(default_factory=dict)
    standalone: Optional[bool] = None  # noqa: UP045
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: Optional[str] = None  # noqa: UP045  (default: <job dir>/logs)


ConfigStore.instance().store(
    group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="distsync"
)


def _run_as_world(task_function: TaskFunction, options: dict[str, Any], cfg: DictConfig) -> Any:
    from distsync.elastic import launch

    return launch(task_function, cfg, **options)


class TorchrunLauncher(Launcher):
    """Runs each job of a sweep, one after the other, as a torchrun world of its own."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.config: Optional[DictConfig] = None  # noqa: UP045
        self.task_function: Optional[TaskFunction] = None  # noqa: UP045
        self.hydra_context: Optional[HydraContext] = None  # noqa: UP045

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        from distsync.elastic import check_options

        try:  # once, before any job: one line, rather than one failed job after another
            check_options(**self._options_for(initial_job_idx))
        except ValueError as error:
            raise ConfigCompositionException(f"hydra.launcher: {error}") from None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs, each a torchrun world")
        runs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            task = functools.partial(_run_as_world, self.task_function, self._options_for(idx))
            runs.append(
                run_job(
                    hydra_context=self.hydra_context,
                    task_function=task,
                    config=sweep_config,
                    job_dir_key="hydra.sweep.dir",
                    job_subdir_key="hydra.sweep.subdir",
                )
            )
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs

    def _options_for(self, idx: int) -> dict[str, Any]:
        options = {k: v for k, v in self.options.items() if not k.startswith("_")}
        options = OmegaConf.to_container(OmegaConf.create(options), resolve=True)
        if options.get("rdzv_id"):
            options["rdzv_id"] = f"{options['rdzv_id']}-{idx}"
        return options
