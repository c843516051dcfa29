"""The worker side of :func:`distsync.launch`: what every rank receives, and how it runs and ends.

Every rank gets ``fn`` and ``cfg`` packed once in the launching process (by reference where the workers
can import them, else by value) and the launching Hydra job's state. :func:`run_rank` restores that state,
sets up logging as Hydra would, runs ``fn(cfg)`` and tells the agent how the rank ended: its result, or why
it ended without one (an exception, ``sys.exit``, ``KeyboardInterrupt``), written to the error file that
the elastic agent reads for a rank that gives no result.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import importlib
import inspect
import json
import logging
import os
import pickle
import runpy
import signal
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from distsync.launching.lifeline import die_with_parent
from distsync.launching.streams import LaunchingStreams
from distsync.launching.world_size import WorldSizeRequest
from distsync.tuning import report_result

_PEER_FAILURE_GRACE_S = 1.0  # a failed worker waits this long before it exits (see run_rank)
_RANK_FORK_SERVER_MODULE = "distsync.launching.rank_fork_server"  # what a rank's own fork server imports


class NonRetryableError(RuntimeError):
    """Raised by ``fn`` on every rank for a failure that restarting the world would only repeat (a bad
    config found while building the model): :func:`~distsync.launch` stops the world at once,
    without using a restart, and raises :class:`~distsync.LaunchError` with this message. Under an
    external ``torchrun`` it is an ordinary failure: torchrun's agent restarts on any failure. Defined on the
    workers' side, where it is raised; exported as ``distsync.NonRetryableError``."""


# ------------------------------------------------------------------------------------------ fn and cfg


class _FunctionRef:
    """A picklable way back to ``fn``: module and name, unwrapped (``@hydra.main``'s inner task function)."""

    def __init__(self, fn: Callable) -> None:
        self.module, self.qualname = fn.__module__, fn.__qualname__

    def resolve(self) -> Callable:
        target = importlib.import_module(self.module)
        for name in self.qualname.split("."):
            target = getattr(target, name)
        return inspect.unwrap(target)


class Pickled:
    """Objects pickled in the launching process and unpickled in a worker's :func:`run_rank` (or the other
    way round, for a result), so that a failure to unpickle them is reported as the rank's error."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def unpack(self) -> Any:
        return pickle.loads(self.payload)


def pack(fn: Callable, cfg: Any) -> Pickled | tuple[Any, Any]:
    """``(fn, cfg)`` as the workers receive them.

    By reference (pickle) when the workers can import everything they name, as ``torch.multiprocessing``
    does; else by value, with cloudpickle, in one payload so that a class that ``fn`` and ``cfg`` share
    stays one class in the worker: lambdas and closures, anything defined in a ``__main__`` that the
    workers cannot import (``python -c``, ``python - < script``, a notebook), or that this process itself
    received by value (a task function and its config dataclass in a job of Hydra's submitit launcher).
    A ``cfg`` holding objects that only multiprocessing may pickle, as it starts a worker (a ``Queue``),
    is left to multiprocessing; ``fn`` then travels on its own, pickled here (by value if it must) and
    unpickled in the worker once that has imported the launching script (a function of a script's
    ``__main__`` is found there only then).
    """
    sent = _by_reference(fn) if main_is_importable() else None
    if sent is not None:
        try:
            return Pickled(pickle.dumps((sent, cfg)))
        except (pickle.PicklingError, TypeError, AttributeError):
            pass
        except RuntimeError:  # "... should only be shared between processes through inheritance"
            return Pickled(pickle.dumps(sent)), cfg
    try:
        return by_value((fn, cfg), f"{fn!r} and its config")
    except RuntimeError:  # as above: cloudpickle meets the same refusal
        return by_value(fn, repr(fn)), cfg


def by_value(obj: Any, what: str) -> Pickled:
    """``obj`` pickled by value: functions and classes that the receiving process cannot import go along."""
    try:
        import cloudpickle
    except ImportError:
        raise TypeError(
            f"distsync.launch: cannot send {what} by reference, and cloudpickle is not installed to send "
            "them by value (pip install cloudpickle); or define them in a module file"
        ) from None
    return Pickled(cloudpickle.dumps(obj))


def main_is_importable() -> bool:
    """Whether a spawned worker can import ``__main__`` again: run as ``python -m module`` or from a file."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = getattr(main, "__file__", None)
    return path is not None and os.path.isfile(path)


@dataclasses.dataclass(frozen=True)
class MainModule:
    """How a worker imports the launching script (``__main__``) itself: by module name (``python -m``) or
    by path; None for neither (``python -c``, a notebook: what it defines travels by value)."""

    name: str | None
    path: str | None

    @classmethod
    def of_this_process(cls) -> MainModule:
        main = sys.modules.get("__main__")
        name = getattr(getattr(main, "__spec__", None), "name", None)
        path = getattr(main, "__file__", None)
        return cls(name, path if path is not None and os.path.isfile(path) else None)


@contextlib.contextmanager
def main_import_deferred() -> Iterator[None]:
    """While workers start, hide how ``__main__`` was loaded (its ``__spec__`` and ``__file__``), so that
    ``multiprocessing`` does not import the launching script in a spawned or forkserver worker before the
    worker's environment (``RANK``, ...) is set: :func:`import_main` imports it in the worker afterwards.
    A forked worker keeps this process's ``__main__``, whose attributes :func:`import_main` gives back."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    hidden = {name: main.__dict__.pop(name) for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__distsync_hidden__ = hidden
    if "__spec__" in hidden:
        main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__distsync_hidden__", None)
        main.__dict__.update(hidden)


def import_main(main: MainModule) -> None:
    """In a worker, with its environment set: the launching script as ``__main__`` (and ``__mp_main__``), as
    ``multiprocessing`` would have imported it before (a forked worker already holds it)."""
    current = sys.modules.get("__main__")
    hidden = getattr(current, "__distsync_hidden__", None)
    if hidden is not None:  # forked: this process's copy of the launching process's __main__
        del current.__distsync_hidden__
        current.__dict__.update(hidden)
        return
    loaded = sys.modules.get("__mp_main__")
    if loaded is not None and loaded is not current and getattr(loaded, "__file__", None) == main.path:
        sys.modules["__main__"] = loaded  # a fork server that imported it already
        return
    if main.name is not None and not (main.name == "__main__" or main.name.endswith(".__main__")):
        module = types.ModuleType("__mp_main__")
        sys.modules["__mp_main__"] = module
        module.__dict__.update(runpy.run_module(main.name, run_name="__mp_main__", alter_sys=True))
    elif main.path is not None:
        module = types.ModuleType("__mp_main__")
        sys.modules["__mp_main__"] = module
        module.__dict__.update(runpy.run_path(main.path, run_name="__mp_main__"))
    else:
        return
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _by_reference(fn: Callable) -> Any:
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
    return None


# ------------------------------------------------------------------------------------- Hydra's state


class WorkerSetup:
    """What a worker needs of the launching process: the Hydra job's hydra node (resolved), the log
    directory, the devices of the world (a :class:`~distsync.launching.device_split.DeviceSet`, or None)
    and how to import the launching script."""

    def __init__(self, hydra_cfg: Any, log_dir: str | None, devices: Any = None) -> None:
        self.hydra_cfg, self.log_dir, self.devices = hydra_cfg, log_dir, devices
        self.main = MainModule.of_this_process()
        self.start_method = "spawn"  # how the agent starts the workers (set by distsync.launch)
        self.environ = dict(os.environ)  # the launching process's, now: a forked worker's may be older
        self.streams = LaunchingStreams()  # its stdout, stderr and group, for a fork server's worker

    @classmethod
    def capture(cls, log_dir: str | os.PathLike | None, devices: Any = None) -> WorkerSetup:
        hydra_cfg = None
        if "hydra" in sys.modules:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized():
                hydra_cfg = _resolved_hydra_config(HydraConfig.instance().cfg)
                _plain_plugin_nodes(hydra_cfg.hydra)
                if log_dir is None:
                    log_dir = os.path.join(hydra_cfg.hydra.runtime.output_dir, "logs")
        return cls(hydra_cfg, os.path.abspath(log_dir) if log_dir is not None else None, devices)

    def restore(self, rank: int) -> None:
        """Hydra's config for ``HydraConfig.get()``, and logging as Hydra set it up for the job."""
        if self.hydra_cfg is not None:
            from hydra.core.hydra_config import HydraConfig

            HydraConfig.instance().set_config(self.hydra_cfg)
            _log_as_hydra(self.hydra_cfg.hydra, rank)
        elif self.log_dir is not None:
            _log_to_console(rank)
        if self.log_dir is not None:
            _log_to_rank_file(self.log_dir, rank)


def resolved_copy(node: Any) -> Any:
    """A deep copy of OmegaConf ``node``, every interpolation resolved (Hydra marks its nodes read-only)."""
    from omegaconf import OmegaConf

    node = copy.deepcopy(node)
    for child in (node, *([node.hydra] if "hydra" in node else [])):
        OmegaConf.set_readonly(child, False)
    OmegaConf.resolve(node)
    return node


def _resolved_hydra_config(masked: Any) -> Any:
    """Hydra's config of the job (``HydraConfig.instance().cfg``: the hydra node alone), resolved inside the
    config it was composed with, where its interpolations point (``hydra.run.dir: ${paths.log_dir}/...``,
    ``${task_name}.log``): Hydra keeps that config as the node's parent; a copy of the node alone has lost
    it. Masked to the hydra node again, as Hydra keeps it."""
    from omegaconf import OmegaConf

    try:  # OmegaConf's Node._get_parent (2.0 to 2.3): tests/test_private_apis.py checks it
        composed = masked.hydra._get_parent()
    except AttributeError:
        composed = None
    if composed is None or "hydra" not in composed:
        composed = masked
    return OmegaConf.masked_copy(resolved_copy(composed), "hydra")


def _plain_plugin_nodes(hydra_node: Any) -> None:
    """Turn the plugins' configs in the hydra node (launcher, sweeper: instances of classes the plugins
    define) into plain dicts. A job process that scans Hydra's plugins again (submitit's) re-executes the
    plugins' modules, and their classes then no longer pickle for the workers."""
    from omegaconf import OmegaConf

    for key in list(hydra_node):
        node_type = OmegaConf.get_type(hydra_node, key)
        if dataclasses.is_dataclass(node_type) and not node_type.__module__.startswith("hydra.conf"):
            hydra_node[key] = OmegaConf.to_container(hydra_node[key])


# -------------------------------------------------------------------------------------------- logging

_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
_rank_file: list[logging.Handler] = []  # this rank's log file handler, once set up


def _log_as_hydra(hydra_node: Any, rank: int) -> None:
    """The job's logging config and ``hydra.verbose``, applied as Hydra applies them to a job; rank 0
    keeps its handlers (the console, ``<job dir>/<app>.log``), as the one process of a plain Hydra job."""
    from hydra.core.utils import configure_log

    configure_log(hydra_node.job_logging, hydra_node.verbose)
    if rank != 0:
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()


def _log_to_console(rank: int) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(console)


def _log_to_rank_file(log_dir: str, rank: int) -> None:
    """Root logger to ``<log_dir>/rank<N>.log``, at the level the logger has (DEBUG with hydra.verbose)."""
    os.makedirs(log_dir, exist_ok=True)
    handler = logging.FileHandler(os.path.join(log_dir, f"rank{rank}.log"))
    handler.setFormatter(logging.Formatter(_FORMAT.replace("][%(name)s", f"][rank{rank}][%(name)s")))
    logging.getLogger().addHandler(handler)
    _rank_file.append(handler)


def _to_rank_file(message: str, with_traceback: bool) -> None:
    """``message`` (and the exception being handled) into this rank's log file only: stderr has it."""
    for handler in _rank_file:
        exc_info = sys.exc_info() if with_traceback else None
        record = logging.LogRecord("distsync.launch", logging.ERROR, __file__, 0, message, None, exc_info)
        handler.handle(record)


# ----------------------------------------------------------------------------------------- the worker


def run_rank(sent: Pickled | tuple[Any, Any], setup: WorkerSetup) -> tuple[int, Any]:
    """The entry point of every worker: restore Hydra's state, set up logging, run ``fn(cfg)``.

    Returns ``(rank, result)`` for the agent (the result by value if pickle cannot take it). A rank that
    raises, or calls ``sys.exit``, writes why into the agent's error file and its log file; with exit
    code 0 it ends without a result, which the agent notices. The worker then ends without tearing its
    interpreter down (:func:`_end_without_teardown`).
    """
    setup.streams.adopt()
    die_with_parent()  # an agent that is SIGKILLed cannot stop its workers
    _forked_children_die_with_this_rank()  # its DataLoader workers, which nothing else ends
    _launch_environment(setup.environ)
    if setup.start_method != "spawn":
        _exit_handlers_of_this_worker_only()
    # Registered first, so it runs last: after the exit handlers of whatever fn used (loggers that
    # flush at exit, for one), before the interpreter's teardown.
    atexit.register(_end_without_teardown)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if setup.devices is not None:  # before fn and its config touch CUDA or start torch's threads
            from distsync.launching.device_split import pin_process

            pin_process(setup.devices)
        _rank_zero_only_from_environment(rank)
        import_main(setup.main)  # the launching script, imported now that RANK is set
        setup.restore(rank)
        fn, cfg = sent.unpack() if isinstance(sent, Pickled) else sent
        if isinstance(fn, Pickled):  # sent by value apart from a config that only multiprocessing pickles
            fn = fn.unpack()
        if isinstance(fn, _FunctionRef):
            fn = fn.resolve()
        result = rank, fn(cfg)
        if rank == 0:
            report_result(result[1])
        try:  # the agent's queue pickles it after this returns: fail here instead
            ForkingPickler.dumps(result)
        except (pickle.PicklingError, TypeError, AttributeError):
            result = rank, by_value(result[1], "the returned value")
    except WorldSizeRequest as request:  # fn's own launch asks for another size: not a failure
        result = rank, request
    except NonRetryableError as error:  # every rank says the same: one line for the launcher to print
        _tell_agent(str(error), rank=rank, retry=False)
        _to_rank_file(f"rank {rank} failed, not to be restarted", with_traceback=True)
        _failures.append(error)
        _exit_code[0] = 1
        raise SystemExit(1) from None
    except Exception as error:
        _tell_agent(f"{type(error).__name__}: {error}")
        traceback.print_exc()
        _to_rank_file(f"rank {rank} failed", with_traceback=True)
        _failures.append(error)  # its frames stay alive: nothing they hold is freed before the exit
        # A rank whose collective failed because a peer died must not be the failure the agent sees
        # first: the peer's own death (SIGKILL, an exception) is the one worth reporting.
        time.sleep(_PEER_FAILURE_GRACE_S)
        _exit_code[0] = 1
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C (the agent stops everything then), or fn's own
        _tell_agent("KeyboardInterrupt")
        _to_rank_file(f"rank {rank} interrupted: KeyboardInterrupt", with_traceback=True)
        _exit_code[0] = 128 + signal.SIGINT
        raise SystemExit(_exit_code[0]) from None
    except SystemExit as stop:  # fn's own sys.exit: its code stands
        code = stop.code
        _exit_code[0] = 0 if code is None else code if isinstance(code, int) else 1
        why = "sys.exit()" if code is None else f"sys.exit({code!r})"
        _tell_agent(why)
        _to_rank_file(f"rank {rank} ended by {why} (exit code {_exit_code[0]})", with_traceback=False)
        if _exit_code[0] == 0:  # torch's @record would hand the agent a None result for SystemExit(0)
            raise SystemExit(None) from None
        raise
    _exit_code[0] = 0
    return result


# What torch's elastic agent sets for each worker (LocalElasticAgent._start_workers, and the error file of
# its multiprocessing context): a worker keeps these; tests/test_private_apis.py compares with torch's.
AGENT_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "OMP_NUM_THREADS",
    }
)


def _launch_environment(launched: dict[str, str]) -> None:
    """This worker's environment: the launching process's at the launch, with the agent's per-worker
    variables. A spawned worker has it already; a worker forked from a fork server started earlier has the
    environment of that moment instead (a run directory lock taken since, devices chosen since)."""
    own = {k: v for k, v in os.environ.items() if k in AGENT_VARIABLES or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(launched)
    os.environ.update(own)


def _forked_children_die_with_this_rank() -> None:
    """The processes that this rank's own fork server forks (its DataLoader workers, under the ``forkserver``
    default that a rank inherits) die with the rank, even SIGKILLed: the server imports
    :mod:`distsync.launching.rank_fork_server` besides ``__main__`` (``multiprocessing``'s default preload),
    when this rank first starts a process by ``forkserver``, if ever."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["__main__", _RANK_FORK_SERVER_MODULE])


_LAST_EXIT_PRIORITY = -(2**31)  # below every priority multiprocessing's own finalizers take


def _exit_handlers_of_this_worker_only() -> None:
    """A forked worker (``fork``, ``forkserver``) holds the exit handlers of the process it was forked from
    (the launching process's, the fork server's), and ``multiprocessing`` ends it with ``os._exit``, which
    runs none. Drop the inherited ones, and run this worker's own as ``multiprocessing`` ends the process,
    after every other finalizer, as a spawned worker's run at its exit: after a ``multiprocessing.Queue``'s
    feeder thread has sent what ``put`` left it (joined at priority -5), since the last exit handler ends
    the process (:func:`_end_without_teardown`). ``atexit._clear``/``_run_exitfuncs``: CPython's, 3.x
    (tests/test_private_apis.py checks them)."""
    import multiprocessing.util

    if not (hasattr(atexit, "_clear") and hasattr(atexit, "_run_exitfuncs")):
        return
    atexit._clear()
    multiprocessing.util.Finalize(None, atexit._run_exitfuncs, exitpriority=_LAST_EXIT_PRIORITY)


def _rank_zero_only_from_environment(rank: int) -> None:
    """Lightning's ``rank_zero_only.rank`` is read from the environment once, when Lightning is imported,
    which may have happened before this worker's ``RANK`` was set (in the launching process, a fork server):
    set it to this rank, so that rank-zero-only code (loggers, Hydra templates' ``extras``) runs on rank 0
    alone from the start. Lightning sets it again once its strategy is up."""
    if "lightning_utilities.core.rank_zero" not in sys.modules:
        return  # imported later, it reads this worker's RANK itself
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = rank


def _tell_agent(why: str, *, rank: int | None = None, retry: bool = True) -> None:
    """Write why this rank ends into the error file that the elastic agent reads for a rank without a
    result (torch's JSON layout, with the traceback being handled if any); ``retry=False`` asks the agent
    not to restart the world (:class:`~distsync.launching.elastic.NonRetryableError`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": why,
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        }
    }
    if not retry:
        data["message"]["extraInfo"].update(retry=False, rank=rank)
    with contextlib.suppress(OSError), open(path, "w") as file:
        json.dump(data, file)


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
