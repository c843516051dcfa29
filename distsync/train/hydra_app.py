"""The Hydra side of training: config registration, the task function body and elastic launches.

It turns the composed ``DictConfig`` into a plain :class:`~distsync.train.config.TrainConfig`, checks it,
and either starts a torchrun world of ``trainer.nproc_per_node`` workers (:func:`launch`) or, under an
external ``torchrun`` (``TORCHELASTIC_RUN_ID`` is set), runs :func:`distsync.train.rank_process.run` in
this very process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from distsync.launching.world_size import ask_in_place
from distsync.train.build import check_buildable, check_builtin_data
from distsync.train.config import ConfigError, TrainConfig
from distsync.train.resume import check_resume
from distsync.train.resume_command import record_command
from distsync.train.resume_command import resume_command as command_to_resume
from distsync.train.rundir import (
    LOCK_NAME,
    RECORD_NAME,
    RunDirBusy,
    RunDirLock,
    keep_hydra_record,
    restore_hydra_record,
    slurm_step,
)

__all__ = [
    "to_train_config",
    "prepare_argv",
    "default_run_dir",
    "hydra_main",
    "launch",
    "under_torchrun",
    "main",
]

# The schema of conf/config.yaml (its first defaults entry): the dataclasses hold every default and check.
ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def under_torchrun() -> bool:
    """True in a process that an external ``torchrun`` (or any elastic agent) started as a worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Resolve ``cfg`` into a :class:`TrainConfig`; raises :class:`ConfigError` naming the bad key."""
    try:
        # Hydra's "+key=..." adds keys the schema lacks, which to_object would drop: the schema refuses them.
        OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.to_container(cfg, resolve=False))
        train_cfg = OmegaConf.to_object(cfg)
    except ConfigKeyError as error:
        raise ConfigError(f"{error.full_key}: not a key of the training config") from error
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "config"
        message = getattr(error, "msg", None) or str(error)
        raise ConfigError(f"{key}: {message.splitlines()[0]}") from error
    if not isinstance(train_cfg, TrainConfig):
        raise ConfigError(f"config: expected the train_schema structure, got {type(train_cfg).__name__}")
    return train_cfg


class JobFailed(CompactHydraException, RuntimeError):
    """A job of a ``-m`` sweep failed: Hydra records it, runs the remaining jobs, then exits non-zero.

    Compact: at the end of the sweep Hydra names the failed job and prints this message, no traceback.
    """


def _fail(message: str, error: BaseException | None = None) -> None:
    """Exit non-zero with a short message (fail the job, in a sweep), or re-raise with HYDRA_FULL_ERROR=1."""
    if error is not None and os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise JobFailed(message) from None  # SystemExit would end the whole sweep here
    raise SystemExit(1)


# ----------------------------------------------------------------------------------------- external torchrun

# How long other ranks wait for rank 0 to report an error that every rank detected; torchrun stops them
# as soon as rank 0 exits.
_WAIT_FOR_RANK0_S = 60.0


def prepare_argv(argv: list[str] | None = None) -> None:
    """Record the command line, and adjust it in a worker of an external ``torchrun``.

    Refuses ``-m``/``--multirun`` (a sweep would start one world per job inside a world). Only rank 0
    keeps ``hydra.output_subdir``, so ``.hydra/`` is written once. (The default run directory is shared by
    :func:`default_run_dir`, so a ``hydra.run.dir`` from the command line or a config file still wins.)
    """
    argv = sys.argv if argv is None else argv
    record_command()  # for the resume command of the processes this one starts (submitit's jobs, ...)
    if not under_torchrun():
        return
    if any(arg in ("-m", "--multirun") or arg.startswith("hydra.mode=") for arg in argv[1:]):
        _refuse(
            "-m/--multirun cannot run under an external torchrun: every sweep job starts its own torchrun "
            "world. Run the sweep without torchrun: python launch/train.py -m ..."
        )
    if int(os.environ.get("RANK", "0")) != 0:
        argv.append("hydra.output_subdir=null")


def _refuse_early(message: str, error: BaseException) -> None:
    """Fail a job refused before training: like :func:`_fail`, and a single run leaves no run directory
    behind if Hydra made it for this job alone (nothing in it but Hydra's record and the lock)."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.RUN:
        _discard_fresh_run_dir(Path(HydraConfig.get().runtime.output_dir))
    _fail(message, error)


_STARTED = time.time()


def _discard_fresh_run_dir(run_dir: Path) -> None:
    try:
        fresh = run_dir.stat().st_ctime >= _STARTED - 1  # made by this process, not an earlier run's
        only_record = {p.name for p in run_dir.iterdir()} <= {".hydra", RECORD_NAME, LOCK_NAME}
    except OSError:
        return
    if fresh and only_record:
        shutil.rmtree(run_dir, ignore_errors=True)
        for parent in run_dir.parents[:2]:  # outputs/<date>, outputs: if made for this run alone
            with contextlib.suppress(OSError):
                if parent.stat().st_ctime < _STARTED - 1:
                    break
                parent.rmdir()  # only if empty


def _refuse(message: str) -> None:
    """Exit with ``message``; under torchrun rank 0 says it and the other ranks wait to be stopped."""
    if under_torchrun() and int(os.environ.get("RANK", "0")) != 0:
        # Exiting first would let torchrun stop rank 0 before it says why.
        time.sleep(_WAIT_FOR_RANK0_S)
        raise SystemExit(1)
    _fail(message)


def default_run_dir() -> str:
    """The default ``hydra.run.dir``: ``outputs/<date>/<time>``, the same on every rank of a torchrun job.

    In a SLURM job step it is ``outputs/slurm/<job id>.<step id>`` (:func:`.rundir.slurm_step`), the same
    on every node, and again when the job is requeued, which then resumes there. Outside torchrun
    it is Hydra's own default. Under torchrun the first rank to ask the agent's store
    decides, and the other ranks (and restarted workers) read it back; without an agent store (etcd
    rendezvous, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) it is ``outputs/torchrun/<run id>``.
    Registered as the OmegaConf resolver ``${distsync_run_dir:}``, which ``conf/config.yaml`` uses.
    """
    step = slurm_step()
    if step is not None:
        return f"outputs/slurm/{step}"
    candidate = datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")
    if not under_torchrun():
        return candidate
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return f"outputs/torchrun/{run_id}"
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    # compare_set writes only when the key is absent, and returns the value that is stored in the end.
    return store.compare_set(f"distsync/run_dir/{run_id}", "", candidate).decode()


OmegaConf.register_new_resolver("distsync_run_dir", default_run_dir, use_cache=True, replace=True)


def installed_doc(name: str) -> str:
    """Where the documentation file ``name`` (``training.md``) is installed with the package, for
    ``--help``: a wheel has no ``docs/`` folder. Registered as the resolver ``${distsync_doc:name}``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


OmegaConf.register_new_resolver("distsync_doc", installed_doc, replace=True)


# ------------------------------------------------------------------------------------------- task function


def hydra_main(cfg: DictConfig) -> float:
    """Body of ``launch/train.py``'s ``@hydra.main`` task: validate, train, return rank 0's final metric."""
    try:
        train_cfg = to_train_config(cfg)
        if under_torchrun():  # in a world whose launcher leaves its size to the job: trainer.nproc_per_node
            ask_in_place(train_cfg.trainer.nproc_per_node)
        _check_environment(train_cfg)
    except ConfigError as error:
        _refuse_early(str(error), error)
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    if under_torchrun():  # an external torchrun (prepare_argv refused -m there), or hydra/launcher=torchrun
        summary = _run_in_this_worker(train_cfg, run_dir)
    else:
        try:
            summary = launch(train_cfg, run_dir)
        except ConfigError as error:  # ResumeError included
            _refuse_early(str(error), error)
    return summary[train_cfg.trainer.metric]


def _run_in_this_worker(cfg: TrainConfig, run_dir: str) -> dict:
    """Train in this torchrun worker; rank 0 says how to resume, at the start and when stopped."""
    from distsync.train.rank_process import run

    with _saying_how_to_resume(run_dir, int(os.environ.get("RANK", "0")) == 0):
        return run(cfg, run_dir)


@contextlib.contextmanager
def _saying_how_to_resume(run_dir: str, enabled: bool):
    """Print the command that resumes this job (:func:`resume_command`) now, and again if stopped."""
    resume = resume_command(run_dir) if enabled else None
    if resume:
        _say(f"run directory {run_dir}; after an interruption, resume it with: {resume}")
    try:
        yield
    except SystemExit:  # stopped by Ctrl-C or SIGTERM, after saving its steps
        if resume:
            _say(f"to resume: {resume}")
        raise


def _check_environment(cfg: TrainConfig) -> None:
    import torch

    world = cfg.trainer.nproc_per_node * cfg.trainer.nnodes
    if under_torchrun():
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.model.norm == "torch" and not torch.cuda.is_available():  # DDP refuses it on CPU, even alone
        raise ConfigError(
            "model.norm=torch uses nn.SyncBatchNorm, which needs CUDA; "
            "use model.norm=sync (DistSyncBatchNorm runs on CPU/gloo)"
        )
    if cfg.trainer.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("trainer.precision=fp16 needs CUDA (its gradient scaler); use bf16 on the CPU")
    if cfg.trainer.comm_hook == "bf16" and world > 1 and not torch.cuda.is_available():
        raise ConfigError("trainer.comm_hook=bf16 needs CUDA with NCCL 2.10+; use fp16 or powersgd on CPU")
    if cfg.trainer.backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ConfigError(
                "trainer.backend=nccl needs CUDA GPUs, and this machine has none; use auto or gloo"
            )
        if cfg.trainer.nproc_per_node > gpus:
            raise ConfigError(
                f"trainer.nproc_per_node={cfg.trainer.nproc_per_node} but this node has {gpus} GPU(s): NCCL "
                "needs one GPU per process"
            )
    if under_torchrun():  # the workers build the rest, and fail alike on every rank (worker.py)
        if not cfg.data.train:
            check_builtin_data(cfg, world)
    else:  # before any worker starts: a config error costs one line, never a restart
        check_buildable(cfg, world)


# ------------------------------------------------------------------------------------------ elastic launch


def launch(cfg: TrainConfig, run_dir: str) -> dict:
    """Run :func:`distsync.train.rank_process.run` on a torchrun world started by :func:`distsync.launch`.

    Returns rank 0's summary. Single node: localhost on a port the OS picks, so jobs can run side by side.
    Multi-node: ``trainer.nnodes`` agents meet at ``trainer.rdzv_endpoint`` under ``trainer.rdzv_id``;
    under SLURM both default to the job's first host and id (one agent per node, see docs/training.md).
    Workers that die are restarted together up to ``trainer.max_restarts`` times and resume from the
    newest checkpoint.
    """
    from distsync.launching.elastic import LaunchError, check_options
    from distsync.launching.elastic import launch as elastic_launch
    from distsync.train.rank_process import run

    t = cfg.trainer
    options = dict(
        nproc_per_node=t.nproc_per_node,
        nnodes=t.nnodes,
        rdzv_endpoint=t.rdzv_endpoint,
        rdzv_id=t.rdzv_id,
        max_restarts=t.max_restarts,
        monitor_interval=t.monitor_interval,
    )
    try:
        check_options(**options)
    except ValueError as error:
        _refuse_early(str(error), error)
    lock = _lock_for_workers(cfg, run_dir)
    try:
        with _saying_how_to_resume(run_dir, os.environ.get("SLURM_PROCID", "0") == "0"):  # once a step
            return elastic_launch(
                functools.partial(run, run_dir=os.path.abspath(run_dir)), cfg, role="distsync", **options
            )
    except LaunchError as error:
        _fail(f"training failed: {error}", error)
    except ValueError as error:  # a rendezvous setting torchrun cannot use
        _refuse_early(str(error), error)
    finally:
        if lock is not None:
            lock.release()


def resume_command(run_dir: str) -> str | None:
    """The command that resumes this Hydra job (:mod:`distsync.train.resume_command`): a single run with
    ``hydra.run.dir`` pinned to ``run_dir``; a job of a sweep: the whole sweep, ``hydra.sweep.dir`` pinned."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return command_to_resume(run_dir, sweep_dir=str(hydra_cfg.sweep.dir) if multirun else None)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _lock_for_workers(cfg: TrainConfig, run_dir: str) -> RunDirLock | None:
    """Lock ``run_dir`` and check that its checkpoint may be resumed, before any worker starts.

    Both refusals are final: found in a worker, they would cost ``trainer.max_restarts`` futile restarts
    of the world. With several nodes the agents of the other nodes may share the directory (a shared
    filesystem), so there rank 0's worker takes the lock instead, as under an external torchrun.
    """
    from distsync.train.checkpoint import load_newest_checkpoint

    os.makedirs(run_dir, exist_ok=True)
    if cfg.trainer.nnodes > 1:
        return None
    try:
        lock = RunDirLock(run_dir, for_workers=True).acquire()
    except RunDirBusy as busy:
        restore_hydra_record(run_dir)  # Hydra overwrote the running job's .hydra/ with this one's
        _fail(str(busy))
    try:
        found = load_newest_checkpoint(run_dir, logging.getLogger("distsync.train"))
        if found is not None:
            path, state = found
            check_resume(state["config"], dataclasses.asdict(cfg), state["step"], str(path))
    except BaseException:
        restore_hydra_record(run_dir)
        lock.release()
        raise
    keep_hydra_record(run_dir)  # this job trains here: its record is the one to keep
    return lock


# ------------------------------------------------------------------------------------------- console script


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _packaged_task(cfg: DictConfig) -> float:
    return hydra_main(cfg)


def main() -> None:
    """``distsync-train``: the training job of ``launch/train.py``, from the configs inside the package.

    The current directory goes first on ``sys.path``, as ``python -m`` does, so that a ``_target_`` of the
    project it runs in (``my_pkg.make_net``) imports, in this process and in the workers it spawns.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    prepare_argv()
    _packaged_task()
