"""Run a function on every rank of a torchrun world: :func:`launch`, the one launch path of distsync.

:func:`launch` starts the world with :func:`torch.distributed.launcher.api.elastic_launch`, the engine
``torchrun`` itself runs, and hands every worker the same configuration. Inside a Hydra app it also carries
Hydra's state across: the config is resolved once, here, so ``${now:...}`` and ``${hydra:...}`` read the same
on every rank; ``HydraConfig.get()`` works in the workers; every rank logs to ``<job dir>/logs/rank<N>.log``.

This module imports Hydra and OmegaConf only when it is handed a ``DictConfig`` or runs inside a Hydra job:
``import distsync`` stays free of both.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import importlib
import inspect
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn, TypeVar

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

__all__ = ["LaunchError", "launch", "under_elastic_agent"]

T = TypeVar("T")

_SLURM_RDZV_PORT = 29500
_PEER_FAILURE_GRACE_S = 1.0  # a failed worker waits this long before it exits (see _run_rank)
_MULTI_NODE_RDZV_TIMEOUT_S = 900  # agents of a multi-node job may start minutes apart (SLURM, submitit)


class LaunchError(RuntimeError):
    """The workers of a :func:`launch` failed (after every allowed restart).

    An ``Exception``, not ``SystemExit``: in a Hydra ``-m`` sweep the job is recorded as failed, the other
    jobs still run, and the command exits non-zero at the end.

    Attributes:
        failures: ``{global rank: (exit code, message)}`` of the workers that failed
    """

    def __init__(self, message: str, failures: dict[int, tuple[int, str]] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


def under_elastic_agent() -> bool:
    """True in a process started as a worker by ``torchrun`` or another elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launch(
    fn: Callable[[Any], T],
    cfg: Any,
    *,
    nproc_per_node: int | str = 1,
    nnodes: int | str = 1,
    rdzv_backend: str = "c10d",
    rdzv_endpoint: str = "",
    rdzv_id: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    standalone: bool | None = None,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    start_method: str = "spawn",
    log_dir: str | os.PathLike | None = None,
    role: str = "default",
) -> T:
    """Run ``fn(cfg)`` on every rank of a torchrun world and return rank 0's return value.

    The world is started by :func:`torch.distributed.launcher.api.elastic_launch`: every worker finds the
    usual torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...), so ``fn``
    joins it with :func:`distsync.init_distributed` (or ``torch.distributed.init_process_group``). When
    this process already is such a worker (started by ``torchrun`` or any elastic agent), ``fn(cfg)`` runs
    right here instead: no second world is nested inside the first.

    In a Hydra app (``cfg`` a ``DictConfig``, or a Hydra job running), the config is resolved once in this
    process and every rank gets the same values (``${now:...}`` included); the workers see
    ``HydraConfig.get()`` as this job does; each rank logs to ``<job output dir>/logs/rank<N>.log`` and
    rank 0 also to the console.

    Args:
        fn: the per-rank function; importable (module level) or picklable, and ``cfg`` picklable, as
            with ``torch.multiprocessing`` spawn
        cfg: its single argument (a ``DictConfig``, a dataclass, anything picklable)
        nproc_per_node: workers on this node; an int, or ``"gpu"``/``"cpu"``/``"auto"`` as for
            ``torchrun``. Default: 1
        nnodes: nodes, ``N`` or ``"MIN:MAX"`` (elastic). Default: 1
        rdzv_backend: rendezvous backend (``c10d``, ``etcd``, ``etcd-v2``, ``static``). Default: ``"c10d"``
        rdzv_endpoint: ``host:port`` where the nodes meet. Under SLURM with ``nnodes > 1`` it defaults
            to the allocation's first host, port 29500. Default: ``""``
        rdzv_id: the job's id, the same on every node; under SLURM the job id. Default: ``""``
        rdzv_conf: extra rendezvous settings (``{"timeout": 900}`` by default with several nodes)
        standalone: one node meeting at ``localhost`` on a free port (under a fresh id unless
            ``rdzv_id`` is given), as ``torchrun --standalone``; so concurrent jobs never collide.
            Default: with ``nnodes == 1`` and no ``rdzv_endpoint``
        max_restarts: times the whole world is restarted after a worker fails. Default: 0
        monitor_interval: seconds between the agent's checks of its workers. Default: 0.1
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``. Default: ``"spawn"``
        log_dir: where rank ``N`` writes ``rank<N>.log`` (the root logger). Default: ``logs/`` in the
            Hydra job's output directory, or no files outside Hydra
        role: the workers' role name in the elastic agent's logs. Default: ``"default"``

    Returns:
        what ``fn`` returned on global rank 0 (on a node without rank 0: on that node's lowest rank)

    Raises:
        LaunchError: when the workers failed and no restart was left; it names the failed ranks.

    Example::

        >>> @hydra.main(config_path="conf", config_name="config", version_base="1.3")
        ... def main(cfg):
        ...     return distsync.launch(train, cfg, nproc_per_node=2)
    """
    if under_elastic_agent():
        return fn(cfg)

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    min_nodes, max_nodes = _parse_nnodes(nnodes)
    if standalone is None:
        standalone = max_nodes == 1 and not rdzv_endpoint
    if standalone:
        if max_nodes != 1:
            raise ValueError(f"standalone=True runs one node, got nnodes={nnodes!r}")
        rdzv_backend, rdzv_endpoint, rdzv_id = "c10d", "localhost:0", rdzv_id or uuid.uuid4().hex
    else:
        rdzv_endpoint, rdzv_id = _rendezvous(rdzv_endpoint, rdzv_id, max_nodes)
    if rdzv_conf is None:
        rdzv_conf = {"timeout": _MULTI_NODE_RDZV_TIMEOUT_S} if max_nodes > 1 else {}

    hydra_state = _HydraState.capture(cfg, log_dir)
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=_nproc(nproc_per_node),
        run_id=rdzv_id,
        role=role,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=dict(rdzv_conf),
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if max_nodes > 1:  # the rendezvous says nothing while it waits, up to its timeout
        print(
            f"waiting for {min_nodes} node(s) at {rdzv_endpoint} (rendezvous {rdzv_id})",
            file=sys.stderr,
            flush=True,
        )
    try:
        results = elastic_launch(config, _run_rank)(_portable(fn), hydra_state.cfg, hydra_state)
    except ChildFailedError as error:
        raise _launch_error(error, max_restarts) from error
    except SignalException as stopped:
        _stop_the_caller(stopped.sigval)
    if not results:  # an elastic agent that stopped without running workers
        raise LaunchError("the elastic agent returned no result from any worker")
    _, value = min(results.values(), key=lambda pair: pair[0])
    return value


# ------------------------------------------------------------------------------------------------ options


def _parse_nnodes(nnodes: int | str) -> tuple[int, int]:
    text = str(nnodes)
    lo, _, hi = text.partition(":")
    try:
        min_nodes, max_nodes = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"nnodes must be N or MIN:MAX, got {nnodes!r}") from None
    if not 1 <= min_nodes <= max_nodes:
        raise ValueError(f"nnodes must satisfy 1 <= MIN <= MAX, got {nnodes!r}")
    return min_nodes, max_nodes


def _nproc(nproc_per_node: int | str) -> int:
    if isinstance(nproc_per_node, int) or str(nproc_per_node).isdigit():
        count = int(nproc_per_node)
    else:
        from torch.distributed.run import determine_local_world_size

        count = determine_local_world_size(str(nproc_per_node))  # "gpu", "cpu", "auto"
    if count < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node!r}")
    return count


def _rendezvous(endpoint: str, run_id: str, max_nodes: int) -> tuple[str, str]:
    """The rendezvous endpoint and id of a multi-node job; inside a SLURM job, defaults from SLURM."""
    if "SLURM_JOB_ID" in os.environ and (not endpoint or not run_id):
        host, job_id = slurm_first_host_and_id()
        endpoint = endpoint or f"{host}:{_SLURM_RDZV_PORT}"
        run_id = run_id or job_id
    if not endpoint and max_nodes > 1:
        raise ValueError("rdzv_endpoint must be host:port when nnodes > 1 outside SLURM")
    return endpoint or "localhost:0", run_id or "distsync"


def slurm_first_host_and_id() -> tuple[str, str]:
    """First host of the SLURM allocation and the job id, from submitit or else scontrol."""
    try:
        import submitit

        env = submitit.JobEnvironment()
        return env.hostnames[0], str(env.job_id)
    except (ImportError, RuntimeError):
        nodes = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return nodes[0] if nodes else socket.gethostname(), os.environ["SLURM_JOB_ID"]


def _stop_the_caller(signum: int) -> NoReturn:
    """The agent was stopped by ``signum`` (Ctrl-C, a scheduler's SIGTERM) and stopped its workers: stop
    the caller too, as the signal meant, rather than fail one job of a sweep that would start the next."""
    name = signal.Signals(signum).name
    print(f"distsync.launch: stopped by {name}; the workers were stopped", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)  # the shell's code for a process ended by the signal


def _launch_error(error, max_restarts: int) -> LaunchError:
    failures = {rank: (f.exitcode, _failure_text(f.message)) for rank, f in sorted(error.failures.items())}
    first_rank, (code, message) = next(iter(failures.items()))
    lines = message.strip().splitlines()
    why = lines[0] if lines else f"exit code {code}"
    return LaunchError(
        f"{len(failures)} worker(s) failed after {max_restarts} restart(s); first, rank {first_rank}: {why}",
        failures,
    )


def _failure_text(message: Any) -> str:
    """The error a worker reported: elastic's error file holds a string or ``{"message": ..., ...}``."""
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "")


# ------------------------------------------------------------------------------------ what workers get


class _FunctionRef:
    """A picklable way back to ``fn``: module and name, unwrapped (``@hydra.main``'s inner task function)."""

    def __init__(self, fn: Callable) -> None:
        self.module, self.qualname = fn.__module__, fn.__qualname__

    def resolve(self) -> Callable:
        target = importlib.import_module(self.module)
        for name in self.qualname.split("."):
            target = getattr(target, name)
        return inspect.unwrap(target)


def _portable(fn: Callable) -> Any:
    """``fn`` itself if pickle takes it; else a :class:`_FunctionRef`, or cloudpickle's bytes."""
    try:
        pickle.dumps(fn)
        return fn
    except (pickle.PicklingError, TypeError, AttributeError):
        pass
    ref = _FunctionRef(fn)
    try:
        if ref.resolve() is fn:  # e.g. the task function under @hydra.main, whose name is the wrapper's
            return ref
    except (ImportError, AttributeError):
        pass
    try:
        import cloudpickle
    except ImportError:
        raise TypeError(
            f"distsync.launch: cannot pickle {fn!r} for the workers; define it at module level"
        ) from None
    return _Cloudpickled(cloudpickle.dumps(fn))


class _Cloudpickled:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def resolve(self) -> Callable:
        return pickle.loads(self.payload)


class _HydraState:
    """What a worker needs of the launching Hydra job: the hydra node (resolved) and the log directory."""

    def __init__(self, cfg: Any, hydra_cfg: Any, log_dir: str | None) -> None:
        self.cfg, self.hydra_cfg, self.log_dir = cfg, hydra_cfg, log_dir

    @classmethod
    def capture(cls, cfg: Any, log_dir: str | os.PathLike | None) -> _HydraState:
        hydra_cfg = None
        if "omegaconf" in sys.modules:
            from omegaconf import DictConfig, ListConfig

            if isinstance(cfg, DictConfig | ListConfig):  # resolved once, here: every rank reads the same
                cfg = _resolved_copy(cfg)
        if "hydra" in sys.modules:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized():
                hydra_cfg = _resolved_copy(HydraConfig.instance().cfg)
                _plain_plugin_nodes(hydra_cfg.hydra)
                if log_dir is None:
                    log_dir = os.path.join(hydra_cfg.hydra.runtime.output_dir, "logs")
        return cls(cfg, hydra_cfg, os.path.abspath(log_dir) if log_dir is not None else None)

    def restore(self) -> None:
        if self.hydra_cfg is not None:
            from hydra.core.hydra_config import HydraConfig

            HydraConfig.instance().set_config(self.hydra_cfg)


def _resolved_copy(node: Any) -> Any:
    """A deep copy of OmegaConf ``node``, every interpolation resolved (Hydra marks its nodes read-only)."""
    from omegaconf import OmegaConf

    node = copy.deepcopy(node)
    for child in (node, *([node.hydra] if "hydra" in node else [])):
        OmegaConf.set_readonly(child, False)
    OmegaConf.resolve(node)
    return node


def _plain_plugin_nodes(hydra_node: Any) -> None:
    """Turn the plugins' configs in the hydra node (launcher, sweeper: instances of classes the plugins
    define) into plain dicts. A job process that scans Hydra's plugins again (submitit's) re-executes the
    plugins' modules, and their classes then no longer pickle for the workers."""
    from omegaconf import OmegaConf

    for key in list(hydra_node):
        node_type = OmegaConf.get_type(hydra_node, key)
        if dataclasses.is_dataclass(node_type) and not node_type.__module__.startswith("hydra.conf"):
            hydra_node[key] = OmegaConf.to_container(hydra_node[key])


def _log_to_files(log_dir: str, rank: int) -> None:
    """Root logger: ``<log_dir>/rank<N>.log`` on every rank, the console on rank 0 only."""
    os.makedirs(log_dir, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(os.path.join(log_dir, f"rank{rank}.log"))
    file_handler.setFormatter(
        logging.Formatter(f"[%(asctime)s][rank{rank}][%(name)s][%(levelname)s] - %(message)s")
    )
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(console)


def _run_rank(fn: Any, cfg: Any, state: _HydraState) -> tuple[int, Any]:
    """The entry point of every worker: restore Hydra's state, set up logging, run ``fn(cfg)``.

    The worker then ends without tearing its interpreter down (:func:`_end_without_teardown`).
    """
    from distsync.train.lifeline import die_with_parent

    die_with_parent()  # an agent that is SIGKILLed cannot stop its workers
    # Registered first, so it runs last: after the exit handlers of whatever fn used (loggers that
    # flush at exit, for one), before the interpreter's teardown.
    atexit.register(_end_without_teardown)
    try:
        rank = int(os.environ.get("RANK", "0"))
        state.restore()
        if state.log_dir is not None:
            _log_to_files(state.log_dir, rank)
        if isinstance(fn, _FunctionRef | _Cloudpickled):
            fn = fn.resolve()
        result = rank, fn(cfg)
        ForkingPickler.dumps(result)  # the agent's queue pickles it after this returns: fail here instead
    except Exception as error:
        get_error_handler().record_exception(error)  # what the agent reports as the rank's failure
        traceback.print_exc()
        _failures.append(error)  # its frames stay alive: nothing they hold is freed before the exit
        # A rank whose collective failed because a peer died must not be the failure the agent sees
        # first: the peer's own death (SIGKILL, an exception) is the one worth reporting.
        time.sleep(_PEER_FAILURE_GRACE_S)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C, or the agent stopping its workers with SIGINT: nothing to report
        _exit_code[0] = 128 + signal.SIGINT
        raise SystemExit(_exit_code[0]) from None
    except SystemExit as stop:  # fn's own sys.exit: its code stands
        _exit_code[0] = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        raise
    _exit_code[0] = 0
    return result


_exit_code = [1]  # what _end_without_teardown exits with: 0 once fn's result is ready for the agent
_failures: list[BaseException] = []


def _end_without_teardown() -> None:
    """Flush the logs and end the process, skipping the interpreter's teardown.

    A gloo process group whose last reference goes away while one of its threads still destroys a
    collective issued in backward deadlocks: the group joins that thread holding the GIL, the thread waits
    for the GIL (see pytorch/pytorch#190489). That last reference is often dropped late: by a traceback's
    frames, or by module teardown at exit. Nothing is left to do in a worker at this point.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_exit_code[0])
