"""Run a function on every rank of a torchrun world: :func:`launch`, the one launch path of distsync.

:func:`launch` starts the world with :func:`torch.distributed.launcher.api.elastic_launch`, the engine
``torchrun`` itself runs, and hands every worker the same configuration. Inside a Hydra app it also carries
Hydra's state across: the config is resolved once, here, so ``${now:...}`` and ``${hydra:...}`` read the same
on every rank; ``HydraConfig.get()`` works in the workers; every rank logs to ``<job dir>/logs/rank<N>.log``.
This module checks the options and the rendezvous, starts the agent and turns what it returns into rank 0's
value or a :class:`LaunchError`; the workers' side is :mod:`distsync.launching.worker`, the agent's additions
:mod:`distsync.launching.agent`, and workers die with their agent through :mod:`distsync.launching.lifeline`.

This module imports Hydra and OmegaConf only when it is handed a ``DictConfig`` or runs inside a Hydra job:
``import distsync`` stays free of both.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from distsync.launching.rendezvous import RendezvousError, check_store_answers, claimed_store
from distsync.launching.slurm_rendezvous import (
    SlurmRendezvous,
    claimed_slurm_store,
    slurm_rendezvous,
    slurm_run_id,
)
from distsync.launching.worker import NonRetryableError
from distsync.launching.world_size import ask_in_place, sized_by_fn

if TYPE_CHECKING:
    from distsync.launching.device_split import DeviceSet

__all__ = [
    "LaunchError",
    "NonRetryableError",
    "check_options",
    "launch",
    "start_fork_server",
    "under_elastic_agent",
]

T = TypeVar("T")

_MULTI_NODE_RDZV_TIMEOUT_S = 900  # agents of a multi-node job may start minutes apart (SLURM, submitit)
_RDZV_TIMEOUT_S = 600  # torch's default for every rendezvous backend
_START_METHODS = ("spawn", "fork", "forkserver")
_WORKER_MODULE = "distsync.launching.worker"  # what each worker imports first
# what the fork server imports (fork_server.py reads it there; importing that module here would block SIGTERM)
_FORK_SERVER_IMPORTS = "DISTSYNC_FORK_SERVER_IMPORTS"

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The workers of a :func:`launch` failed (after every allowed restart).

    An ``Exception``, not ``SystemExit``: in a Hydra ``-m`` sweep the job is recorded as failed, the other
    jobs still run, and the command exits non-zero at the end.

    Attributes:
        failures: ``{global rank: (exit code, why)}`` of the workers that failed, and of those that ended
            without a result (exit code 0); ``why`` is one line: the exception, ``sys.exit(...)``,
            ``KeyboardInterrupt``, ``killed by SIGKILL`` or the exit code
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
    nproc_per_node: int | str | None = 1,
    nnodes: int | str = 1,
    rdzv_backend: str = "c10d",
    rdzv_endpoint: str = "",
    rdzv_id: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    standalone: bool | None = None,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    start_method: str = "forkserver",
    log_dir: str | os.PathLike | None = None,
    role: str = "default",
    devices: DeviceSet | None = None,
) -> T:
    """Run ``fn(cfg)`` on every rank of a torchrun world and return rank 0's return value.

    The world is started by :func:`torch.distributed.launcher.api.elastic_launch`: every worker finds the
    usual torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...), so ``fn``
    joins it with :func:`distsync.init_distributed` (or ``torch.distributed.init_process_group``). When
    this process already is such a worker (started by ``torchrun`` or any elastic agent), ``fn(cfg)`` runs
    right here instead: no second world is nested inside the first.

    In a Hydra app (``cfg`` a ``DictConfig``, or a Hydra job running), the config is resolved once in this
    process and every rank gets the same values (``${now:...}`` included); the workers see
    ``HydraConfig.get()`` as this job does; every rank applies the job's logging config and
    ``hydra.verbose``, rank 0 logs to the console and ``<app>.log`` as a plain Hydra job does, and each
    rank to ``<job output dir>/logs/rank<N>.log``.

    A rank that ends with exit code 0 without returning (``sys.exit()``, ``os._exit(0)``) is not waited
    for: once every rank has returned or ended, rank 0's value is returned, or a :class:`LaunchError`
    names the ranks that ended without a result if rank 0 is one of them.

    Args:
        fn: the per-rank function. It and ``cfg`` travel by reference where the workers can import
            them (module level of a file), else by value with cloudpickle (lambdas, closures, what a
            ``python -c`` script or a notebook defines)
        cfg: its single argument (a ``DictConfig``, a dataclass, anything picklable)
        nproc_per_node: workers on this node; an int, or ``"gpu"``/``"cpu"``/``"auto"`` as for
            ``torchrun``; or None: as many as ``fn``'s own ``distsync.launch`` asks for, else 1 (one
            rank starts ``fn``, and the world starts again at the size its launch asks for, see
            :mod:`~distsync.launching.world_size`). Default: 1
        nnodes: nodes, ``N`` or ``"MIN:MAX"`` (elastic). Default: 1
        rdzv_backend: rendezvous backend (``c10d``, ``etcd``, ``etcd-v2``, ``static``). Default: ``"c10d"``
        rdzv_endpoint: ``host:port`` where the nodes meet. Under SLURM with ``nnodes > 1`` it defaults
            to the allocation's first host, on the first of the job's own ports (``20000 + id % 10000``,
            then 15 more that follow from the id) that no other program or run holds, so that two jobs
            never meet in one store (:mod:`~distsync.launching.slurm_rendezvous`). A store that another
            run's agents meet in is refused. Default: ``""``
        rdzv_id: the job's id, the same on every node; under SLURM the job id. Default: ``""``
        rdzv_conf: extra rendezvous settings; ``timeout`` is the rendezvous timeout in seconds, with any
            backend (torch's ``join_timeout`` for ``c10d``). Default: ``{"timeout": 900}`` with several
            nodes, else torch's 600 s
        standalone: one node meeting at ``localhost`` on a free port (under a fresh id unless
            ``rdzv_id`` is given), as ``torchrun --standalone``; so concurrent jobs never collide. The
            agent hosts the store there and meets no one (:mod:`~distsync.launching.local_rendezvous`),
            ``rdzv_backend`` aside. Default: with ``nnodes == 1`` and no ``rdzv_endpoint``
        max_restarts: times the whole world is restarted after a worker fails. Default: 0
        monitor_interval: seconds between the agent's checks of its workers. Default: 0.1
        start_method: how the agent starts its workers: ``"forkserver"`` forks them from a server process
            that imported, once, the libraries this process has imported (torch, Lightning, ...: a worker
            starts in a fraction of a second, not the seconds of importing them again), and that has run
            nothing else; ``"spawn"`` starts each from scratch; ``"fork"`` copies this process, which is
            fastest but unsafe once it has run torch ops (OpenMP's threads do not survive a fork) or
            holds a CUDA context. Each worker imports the launching script itself, after its ``RANK``
            is set. Default: ``"forkserver"`` (``"spawn"`` where there is none)
        log_dir: where rank ``N`` writes ``rank<N>.log`` (the root logger). Default: ``logs/`` in the
            Hydra job's output directory, or no files outside Hydra
        role: the workers' role name in the elastic agent's logs. Default: ``"default"``
        devices: a :class:`~distsync.DeviceSet`, the devices this world runs on, so that several worlds
            share a machine without sharing GPUs or cores: ``DeviceSet("cuda", (2, 3))`` sets every
            worker's ``CUDA_VISIBLE_DEVICES`` to ``2,3`` (its ``cuda:0`` is GPU 2; ``nproc_per_node`` at most
            2, ``"gpu"``/``"auto"`` count 2); ``DeviceSet("cpu", range(4, 8))`` sets every worker's CPU
            affinity to cores 4-7 and torch's threads to their share of them. Set in each worker before
            ``fn`` runs. Several worlds at once: start each from a process of its own (as
            ``hydra.launcher.n_jobs`` does), not from threads, which would share the agent's signal
            handling. Default: None, every device this process sees

    Returns:
        what ``fn`` returned on global rank 0 (on a node without rank 0: on that node's lowest rank)

    Raises:
        LaunchError: when the workers failed and no restart was left, or raised
            :class:`NonRetryableError`, or rank 0 ended without a result; it names those ranks and how
            each ended.
        ValueError: for an option that cannot work, before any worker starts.

    Example::

        >>> @hydra.main(config_path="conf", config_name="config", version_base="1.3")
        ... def main(cfg):
        ...     return distsync.launch(train, cfg, nproc_per_node=2)
    """
    if under_elastic_agent():
        ask_in_place(nproc_per_node)  # in a one-rank world that fn sizes: start it again at this size
        return fn(cfg)
    if nproc_per_node is None:
        options = dict(nnodes=nnodes, rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
        options.update(rdzv_conf=rdzv_conf, standalone=standalone, max_restarts=max_restarts, role=role)
        options.update(monitor_interval=monitor_interval, start_method=start_method, log_dir=log_dir)
        return sized_by_fn(lambda nproc: launch(fn, cfg, nproc_per_node=nproc, devices=devices, **options))

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from distsync.launching.agent import (
        WorldNotRestarted,
        keep_alive_stopped_on_signal,
        ranks_ending_watched,
        signal_behind,
    )
    from distsync.launching.worker import WorkerSetup, main_import_deferred, pack, run_rank

    check_options(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
        rdzv_endpoint=rdzv_endpoint,
    )
    from distsync.launching.device_split import nproc_on, warn_if_crowded

    if devices is not None:
        nproc_per_node = nproc_on(devices, nproc_per_node)
    ranks = _nproc(nproc_per_node)
    warn_if_crowded(ranks, devices)
    min_nodes, max_nodes = _parse_nnodes(nnodes)
    if standalone is None:
        standalone = max_nodes == 1 and not rdzv_endpoint
    if standalone:
        if max_nodes != 1:
            raise ValueError(f"standalone=True runs one node, got nnodes={nnodes!r}")
        from distsync.launching.local_rendezvous import backend  # no join protocol to wait through

        rdzv_backend, rdzv_endpoint, rdzv_id = backend(), "localhost:0", rdzv_id or uuid.uuid4().hex
        slurm = None
    else:
        try:
            rdzv_endpoint, rdzv_id, slurm = _rendezvous(rdzv_endpoint, rdzv_id, max_nodes)
        except RendezvousError as unknown:
            raise LaunchError(str(unknown)) from None
    rdzv_conf, timeout_s = _rendezvous_conf(rdzv_backend, rdzv_conf, max_nodes)

    if start_method == "forkserver" and start_method not in multiprocessing.get_all_start_methods():
        start_method = "spawn"
    setup = WorkerSetup.capture(log_dir, devices)
    setup.start_method = start_method
    sent = pack(fn, _resolved_for_workers(cfg))
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=ranks,
        run_id=rdzv_id,
        role=role,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=rdzv_conf,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
    )
    walks = slurm is not None and rdzv_backend == "c10d"  # the endpoint: the store its walk finds
    if max_nodes > 1 and not walks:
        _say_waiting(config)
    if not standalone and rdzv_backend in ("c10d", "static") and not walks:
        try:
            check_store_answers(rdzv_endpoint, timeout_s)
        except RendezvousError as silent:
            raise LaunchError(str(silent)) from None
    if start_method == "forkserver":
        start_fork_server()
    try:
        with (
            _store_of_this_run(config, standalone, timeout_s, slurm if walks else None),
            ranks_ending_watched(),
            keep_alive_stopped_on_signal(),
            main_import_deferred(),
        ):
            results = elastic_launch(config, run_rank)(sent, setup)
    except ChildFailedError as error:  # its long report adds nothing to the one line of LaunchError
        raise _launch_error(error, max_restarts) from None
    except WorldNotRestarted as stopped:
        raise LaunchError(stopped.message, stopped.failures) from None
    except RendezvousError as refused:
        raise LaunchError(str(refused)) from None
    except Exception as error:  # a signal stopped the agent, or torch's cleanup failed while handling it
        stopped = signal_behind(error)
        if stopped is None:
            raise
        _stop_the_caller(stopped.sigval)
    return _rank_zeros_value(results)


def check_options(
    *,
    nproc_per_node: int | str = 1,
    nnodes: int | str = 1,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    start_method: str = "forkserver",
    rdzv_endpoint: str = "",
    **_: Any,
) -> None:
    """Raise ``ValueError`` with one line if an option of :func:`launch` cannot work; other options pass."""
    _parse_nnodes(nnodes)
    if isinstance(nproc_per_node, int) or str(nproc_per_node).isdigit():
        _nproc(nproc_per_node)
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if not isinstance(monitor_interval, int | float) or not monitor_interval > 0:
        raise ValueError(f"monitor_interval must be a number of seconds > 0, got {monitor_interval!r}")
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(_START_METHODS)}, got {start_method!r}")
    _, colon, port = str(rdzv_endpoint).rpartition(":")
    if colon and not (port.isdigit() and int(port) < 65536):
        raise ValueError(f"rdzv_endpoint {rdzv_endpoint!r}: the port must be an integer between 0 and 65535")


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


def _rendezvous(endpoint: str, run_id: str, max_nodes: int) -> tuple[str, str, SlurmRendezvous | None]:
    """The rendezvous endpoint and id of a multi-node job; inside a SLURM job, defaults from SLURM: then
    also where the job's store is looked for, if the endpoint was not given (its first port until found)."""
    slurm = None
    if "SLURM_JOB_ID" in os.environ:
        run_id = run_id or slurm_run_id()
        if not endpoint:
            slurm = slurm_rendezvous()
            endpoint = f"{slurm.host}:{slurm.ports[0]}"
    if not endpoint and max_nodes > 1:
        raise ValueError("rdzv_endpoint must be host:port when nnodes > 1 outside SLURM")
    return endpoint or "localhost:0", run_id or "distsync", slurm


def _rendezvous_conf(
    backend: str, conf: dict[str, Any] | None, max_nodes: int
) -> tuple[dict[str, Any], float]:
    """The rendezvous settings for torch, and the rendezvous timeout in seconds.

    ``timeout`` is the rendezvous timeout for every backend: the dynamic ones (``c10d``, ``etcd-v2``) call
    it ``join_timeout``, and ignore a ``timeout``. Several nodes wait 900 s by default, one 600 s (torch's).
    """
    key = "join_timeout" if backend in ("c10d", "etcd-v2") else "timeout"
    conf = dict(conf) if conf is not None else {}
    if "timeout" in conf and key != "timeout":
        conf.setdefault(key, conf.pop("timeout"))
    if max_nodes > 1:
        conf.setdefault(key, _MULTI_NODE_RDZV_TIMEOUT_S)
    return conf, float(conf.get(key, _RDZV_TIMEOUT_S))


@contextlib.contextmanager
def _store_of_this_run(
    config: Any, standalone: bool, timeout_s: float, slurm: SlurmRendezvous | None
) -> Iterator[None]:
    """A c10d rendezvous of several agents meets in a store that belongs to this run
    (:func:`~distsync.launching.rendezvous.claimed_store`); torch's rendezvous serves it from this process
    if this process serves it already. With ``slurm``, the store is the one the walk over the job's ports
    finds (:func:`~distsync.launching.slurm_rendezvous.claimed_slurm_store`), and the endpoint becomes its."""
    if standalone or config.rdzv_backend != "c10d":
        yield
    elif slurm is None:
        with claimed_store(config.rdzv_endpoint, config.run_id, timeout_s) as serving:
            config.rdzv_configs.setdefault("is_host", serving)
            yield
    else:
        with claimed_slurm_store(slurm, config.run_id, timeout_s) as (config.rdzv_endpoint, serving):
            config.rdzv_configs.setdefault("is_host", serving)
            if config.max_nodes > 1:
                _say_waiting(config)
            yield


def _say_waiting(config: Any) -> None:
    """The rendezvous says nothing while it waits, up to its timeout: say where it waits."""
    print(
        f"waiting for {config.min_nodes} node(s) at {config.rdzv_endpoint} (rendezvous {config.run_id})",
        file=sys.stderr,
        flush=True,
    )


def _stop_the_caller(signum: int) -> NoReturn:
    """The agent was stopped by ``signum`` (Ctrl-C, a scheduler's SIGTERM) and stopped its workers: stop
    the caller too, as the signal meant, rather than fail one job of a sweep that would start the next."""
    name = signal.Signals(signum).name
    print(f"distsync.launch: stopped by {name}; the workers were stopped", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)  # the shell's code for a process ended by the signal


def start_fork_server() -> None:
    """Start this process's fork server, which imports the libraries this process has imported before it
    forks any worker (a server that runs already keeps what it has). Not ``__main__``: the launching script
    is imported by each worker, once its rank is set. The server outlives a SIGTERM sent to every process
    of the job, so that the workers can save their steps (:mod:`distsync.launching.fork_server`).
    :func:`launch` calls it; the Hydra plugin calls it as soon as it is set up, so that the server's imports
    overlap the sweep's setup, and the job processes of a packed sweep share one server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    # The installed libraries and their first-level modules, in the order this process imported them: a
    # worker needs what this process's checks of the job needed, and would otherwise import it again in
    # every rank. And torch._dynamo, which torch's optimizers and DDP import when first built (about 1.5 s
    # of CPU): every training worker builds one, so the server imports it once for them all.
    libraries = [
        name
        for name, module in list(sys.modules.items())
        if name.count(".") <= 1 and _is_installed_library(module)
    ]
    if "torch" in libraries and "torch._dynamo" not in libraries:
        libraries.insert(libraries.index("torch") + 1, "torch._dynamo")
    libraries.append(_WORKER_MODULE)  # every worker runs it: distsync itself, installed or not
    context = multiprocessing.get_context("forkserver")
    # The server imports the libraries in fork_server.py, where one that fails to import cannot kill it.
    context.set_forkserver_preload(["distsync.launching.fork_server"])
    from multiprocessing import forkserver, resource_tracker

    # A SIGTERM to every process of the job must not end the server: it starts with SIGTERM blocked (see
    # launching/fork_server.py, which it imports first). The resource tracker, which ignores SIGTERM
    # itself, is started first: starting it unblocks SIGTERM in this thread.
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.environ[_FORK_SERVER_IMPORTS] = ",".join(libraries)  # the server's environment: this one, as it starts
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(_FORK_SERVER_IMPORTS, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _is_installed_library(module: Any) -> bool:
    path = getattr(module, "__file__", None) or ""
    return f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def _resolved_for_workers(cfg: Any) -> Any:
    """An OmegaConf config resolved once, here, so that every rank reads the same values (``${now:}``)."""
    if "omegaconf" in sys.modules:
        from omegaconf import DictConfig, ListConfig

        if isinstance(cfg, DictConfig | ListConfig):
            from distsync.launching.worker import resolved_copy

            return resolved_copy(cfg)
    return cfg


def _launch_error(error, max_restarts: int) -> LaunchError:
    """The failed ranks of torch's ``ChildFailedError``, and the ranks that had ended without a result."""
    from distsync.launching.agent import describe, reported

    failures = {
        rank: (failure.exitcode, describe(failure.exitcode, reported(failure)))
        for rank, failure in sorted(error.failures.items())
    }
    failed = sum(code != 0 for code, _ in failures.values())
    return LaunchError(
        f"{failed} worker(s) failed after {max_restarts} restart(s): {_ranks(failures)}", failures
    )


def _rank_zeros_value(results: dict[int, Any]) -> Any:
    """What the lowest rank of this node returned; a :class:`LaunchError` if it ended without a result."""
    from distsync.launching.agent import NoResult, describe
    from distsync.launching.worker import Pickled

    if not results:  # an elastic agent that stopped without running workers
        raise LaunchError("the elastic agent returned no result from any worker")
    ended = {}
    for rank, value in sorted(results.items()):
        if not isinstance(value, tuple):  # a worker returns (rank, value)
            reason = value if isinstance(value, NoResult) else NoResult(0, "")
            ended[rank] = (reason.exit_code, describe(reason.exit_code, reason.reported))
    if min(results) in ended:
        raise LaunchError(_ranks(ended), ended)
    if ended:
        log.warning(f"distsync.launch: {_ranks(ended)}; rank {min(results)}'s result is returned")
    _, value = results[min(results)]
    return value.unpack() if isinstance(value, Pickled) else value


def _ranks(endings: dict[int, tuple[int, str]]) -> str:
    return "; ".join(
        f"rank {rank}: {why}" if code != 0 else f"rank {rank} ended without a result: {why}"
        for rank, (code, why) in endings.items()
    )
