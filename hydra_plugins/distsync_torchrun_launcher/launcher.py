"""``hydra/launcher=torchrun``: run every job of a Hydra sweep as its own torchrun world.

    python my_app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=4 lr=0.1,0.2
    python my_app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 hydra.launcher.n_jobs=auto \
        lr=0.1,0.2,0.4,0.8      # as many 2-GPU jobs at once as the GPUs hold, each on its own GPUs

Each job's config is composed in this process, as Hydra's basic launcher does, and the task function then
runs on every rank of a world that :func:`distsync.launch` starts for the job: the config resolved once,
one run directory for all ranks, ``HydraConfig`` in the workers, rank 0's return value back to the sweeper.
A job whose workers fail is recorded as failed; the other jobs of the batch still run.

The world's size: ``hydra.launcher.nproc_per_node`` when given (an app's own ``distsync.launch`` then runs
in place, in that world); unset, the size the app's own ``distsync.launch(nproc_per_node=...)`` asks for
(the job's world starts with one rank and starts again at that size, see
:mod:`~distsync.launching.world_size`), and one rank for a task function that never calls it.

With ``hydra.launcher.n_jobs`` > 1 up to that many jobs of a batch run at once, each in a process of its
own (:mod:`~distsync.launching.packing`) and each world on devices of its own: ``nproc_per_node`` GPUs per job
(``CUDA_VISIBLE_DEVICES``), or on a machine without GPUs an equal share of the cores (CPU affinity). The
split is :func:`distsync.devices.split_devices`; ``n_jobs=1``, the default, runs the jobs one after the other
in this process, on every device, as before.
"""

# No ``from __future__ import annotations`` here: Hydra imports plugins outside ``sys.modules``, where
# dataclasses cannot resolve string annotations, and OmegaConf reads these types (hence ``Optional``).

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from hydra.errors import ConfigCompositionException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class TorchrunLauncherConf:
    """Options of :func:`distsync.launch`, named like torchrun's flags."""

    _target_: str = "hydra_plugins.distsync_torchrun_launcher.launcher.TorchrunLauncher"
    # An int, or "gpu" / "cpu" / "auto"; unset: the app's own distsync.launch(nproc_per_node=...), else 1.
    nproc_per_node: Any = None
    nnodes: Any = 1  # N or "MIN:MAX"
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_id: str = ""  # with several nodes, job k of the sweep meets under "<rdzv_id>-<k>"
    rdzv_conf: dict[str, Any] = field(default_factory=dict)
    standalone: Optional[bool] = None  # noqa: UP045
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "forkserver"  # or "spawn", "fork": see distsync.launch
    log_dir: Optional[str] = None  # noqa: UP045  (default: <job dir>/logs)
    n_jobs: Any = 1  # jobs of a batch running at once, each on its own devices: an int, or "auto"


ConfigStore.instance().store(
    group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="distsync"
)


def _run_as_world(task_function: TaskFunction, options: dict[str, Any], cfg: DictConfig) -> Any:
    from distsync.launching.elastic import launch

    return launch(task_function, cfg, **options)


class TorchrunLauncher(Launcher):
    """Runs each job of a sweep as a torchrun world of its own, ``n_jobs`` at a time (default: one)."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.config: Optional[DictConfig] = None  # noqa: UP045
        self.task_function: Optional[TaskFunction] = None  # noqa: UP045
        self.hydra_context: Optional[HydraContext] = None  # noqa: UP045

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function
        _import_the_agent()  # once, here: a packed job's process is forked with it imported
        if self.options.get("start_method", "forkserver") == "forkserver":
            from distsync.launching.elastic import start_fork_server

            start_fork_server()  # its imports overlap the sweep's setup; every job's workers fork from it

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        from distsync.launching.elastic import check_options

        try:  # once, before any job: one line, rather than one failed job after another
            check_options(**self._options_for(initial_job_idx))
            slots = self._slots(len(job_overrides))
        except ValueError as error:
            raise ConfigCompositionException(f"hydra.launcher: {error}") from None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        if slots is not None:
            return self._launch_packed(job_overrides, initial_job_idx, slots)
        log.info(f"Launching {len(job_overrides)} jobs, each a torchrun world")
        runs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(_shown(overrides))}")
            runs.append(self._run_job(idx, self._sweep_config(idx, overrides), None))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs

    def launch_as_slots_free(
        self,
        next_job: Callable[[], Optional[tuple[int, Sequence[str]]]],  # noqa: UP045
        finished: Callable[[int, JobReturn], None],
        max_jobs: int,
    ) -> None:
        """Run jobs as long as ``next_job()`` gives one, ``(job number, overrides)``: each starts the moment
        a slot (its GPUs or cores) is free, and ``finished(number, job_return)`` is called as each ends, in
        the order they end. For asynchronous sweepers (``hydra/sweeper=distsync_optuna``, whose job numbers
        are its trials' numbers); ``max_jobs`` bounds how many jobs there can be, for the split of the
        devices. With ``n_jobs=1`` the jobs run one after the other here.

        A job's config is composed in the job's own process, so that jobs ending together start again
        together. Ctrl-C or SIGTERM stops the running jobs and raises ``SystemExit(128 + signal)``; a job it
        stopped is not reported to ``finished``: it did not end, it was interrupted.
        """
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        from distsync.launching.elastic import check_options

        try:
            check_options(**self._options_for(0))
            slots = self._slots(max_jobs)
        except ValueError as error:
            raise ConfigCompositionException(f"hydra.launcher: {error}") from None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        if slots is None:
            while (job := next_job()) is not None:
                idx, overrides = job
                log.info(f"\t#{idx} : {' '.join(_shown(overrides))}")
                finished(idx, self._run_job(idx, self._sweep_config(idx, overrides), None))
                configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
            return
        from distsync.launching.packing import run_as_slots_free

        where = "GPUs" if slots[0].kind == "cuda" else "cores"
        log.info(f"Launching jobs as {len(slots)} slots free, each a torchrun world on its own {where}")
        launched: dict[int, Sequence[str]] = {}

        def next_packed_job():
            job = next_job()
            if job is None:
                return None
            idx, overrides = job
            launched[idx] = overrides
            return idx, functools.partial(self._compose_and_run_job, idx, overrides)

        def started(idx: int, slot) -> None:
            log.info(f"\t#{idx} : {' '.join(_shown(launched[idx]))} on {slot}")

        def ended(idx: int, how) -> None:
            finished(idx, _job_return(launched.pop(idx), how))

        run_as_slots_free(next_packed_job, slots, started, ended)

    def _compose_and_run_job(self, idx: int, overrides: Sequence[str], devices) -> JobReturn:
        return self._run_job(idx, self._sweep_config(idx, overrides), devices)

    def _sweep_config(self, idx: int, overrides) -> DictConfig:
        assert self.config is not None and self.hydra_context is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = idx
            sweep_config.hydra.job.num = idx
        return sweep_config

    def _run_job(self, idx: int, sweep_config: DictConfig, devices) -> JobReturn:
        assert self.hydra_context is not None and self.task_function is not None
        options = self._options_for(idx)
        if devices is not None:
            options["devices"] = devices
        return run_job(
            hydra_context=self.hydra_context,
            task_function=functools.partial(_run_as_world, self.task_function, options),
            config=sweep_config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )

    def _slots(self, jobs: int) -> Optional[list]:  # noqa: UP045
        """The device sets of the jobs running at once; None to run the jobs one after the other here."""
        from distsync.launching.device_split import split_devices, this_process_devices, warn_if_crowded

        n_jobs = self.options.get("n_jobs", 1)
        n_jobs = int(n_jobs) if str(n_jobs).isdigit() else n_jobs
        if n_jobs == 1:
            return None
        options = self._options_for(0)
        if not sys.platform.startswith("linux"):
            raise ValueError(f"n_jobs={n_jobs} runs jobs side by side on Linux only")
        if (
            str(options.get("nnodes", 1)) != "1"
            or options.get("rdzv_endpoint")
            or options.get("standalone") is False
        ):
            raise ValueError(
                f"n_jobs={n_jobs} packs jobs on one node, each meeting on a free port of its own: it needs "
                "nnodes=1 and no rdzv_endpoint (with several nodes, run one world per job)"
            )
        visible = this_process_devices()
        nproc = options.get("nproc_per_node") or 1  # unset: one rank's devices, the app's world in them
        if not str(nproc).isdigit():
            raise ValueError(f"n_jobs={n_jobs} needs nproc_per_node as a number, got {nproc!r}")
        slots = split_devices(visible, int(nproc), n_jobs, jobs=jobs)
        warn_if_crowded(int(nproc), visible, jobs=len(slots))  # said here once, not by every job
        return slots if len(slots) > 1 else None  # one job at a time: here, on every device, as n_jobs=1

    def _launch_packed(self, job_overrides, initial_job_idx: int, slots: list) -> list[JobReturn]:
        from distsync.launching.packing import job_tag, run_packed

        where = "GPUs" if slots[0].kind == "cuda" else "cores"
        log.info(
            f"Launching {len(job_overrides)} jobs, each a torchrun world, {len(slots)} at a time, "
            f"each on its own {where}"
        )
        jobs = list(enumerate(job_overrides, start=initial_job_idx))
        configs = [self._sweep_config(idx, overrides) for idx, overrides in jobs]

        def started(k: int, slot) -> None:
            idx, overrides = jobs[k]
            log.info(f"\t#{idx} : {' '.join(_shown(overrides))} on {slot}")

        ended = run_packed(
            [
                functools.partial(self._run_job, idx, config)
                for (idx, _), config in zip(jobs, configs, strict=True)
            ],
            slots,
            started,
            tag=lambda k: job_tag(jobs[k][0]),  # the job's number in the sweep, as the lines above say
        )
        return [_job_return(overrides, end) for (_, overrides), end in zip(jobs, ended, strict=True)]

    def _options_for(self, idx: int) -> dict[str, Any]:
        options = {k: v for k, v in self.options.items() if not k.startswith("_") and k != "n_jobs"}
        options = OmegaConf.to_container(OmegaConf.create(options), resolve=True)
        if options.get("rdzv_id"):
            options["rdzv_id"] = f"{options['rdzv_id']}-{idx}"
        return options


def _shown(overrides: Sequence[str]) -> list[str]:
    """The overrides of a job as the console lists them: without Hydra's own (``hydra.``, ``+hydra.``)."""
    return [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]


def _import_the_agent() -> None:
    """What :func:`distsync.launch` imports as it starts a world: torch's elastic agent and distsync's side
    of it (a tenth of a second and more, which every packed job would otherwise pay before its world)."""
    import torch.distributed.launcher.api  # noqa: F401

    import distsync.launching.agent  # noqa: F401
    import distsync.launching.local_rendezvous  # noqa: F401
    import distsync.launching.worker  # noqa: F401


def _job_return(overrides, end) -> JobReturn:
    """What a packed job's process sent back, or a failed ``JobReturn`` if it failed outside its task (or
    died)."""
    if isinstance(end.value, JobReturn):
        return end.value
    return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=end.error)
