"""Spawn small gloo worlds on one machine: the fixture behind the tests and ``python -m distsync.check``."""

from __future__ import annotations

import io
import os
import queue
import random
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["allocations", "free_port", "run_threads", "run_world", "timeout_scale", "WorkerFailed"]

TIMEOUT_SCALE_ENV = "DISTSYNC_TEST_TIMEOUT_SCALE"


class WorkerFailed(RuntimeError):
    """A rank of a spawned world raised, hung, or died; carries every failing rank's traceback."""


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago, chosen at random below the kernel's ephemeral
    range where there is room.

    A port bound to 0 comes from the ephemeral range, from which every outgoing connection on the machine
    (other worlds' ranks meeting their stores, gloo's pairs) takes its local port too: on a busy machine one
    of them can take it before the caller's store binds it (``EADDRINUSE``). Below that range only explicit
    binds compete."""
    low = _ephemeral_start()
    with socket.socket() as sock:
        for port in _PICK.sample(range(_LOWEST, low), k=min(32, max(low - _LOWEST, 0))):
            try:
                sock.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_LOWEST = 20000
_PICK = random.SystemRandom()  # not the random module's state, which tests seed alike in every process


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems start higher


_AFTER_A_FAILURE = 30.0  # seconds the other ranks get to finish once one has raised


def timeout_scale() -> float:
    """How much longer than on an idle machine a test's worlds and jobs may take here: the number in
    ``$DISTSYNC_TEST_TIMEOUT_SCALE`` if set, else the load per core (1-minute load average over the cores
    this process may use), at least 1. :func:`run_world` applies it to its ``timeout``, so a suite run on a
    busy machine is slower, not failed."""
    if os.environ.get(TIMEOUT_SCALE_ENV):
        return max(1.0, float(os.environ[TIMEOUT_SCALE_ENV]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1.0, load / cores)


def _context() -> Any:
    """Where the worlds' processes come from: forked from a server that has imported torch once (a world
    starts in well under a second rather than in two), else spawned where there is no forkserver.

    The server also imports dynamo where this process has (a test suite, a script that compiles):
    ``DistributedDataParallel`` and torch's optimizers import it when first built, about two seconds of
    CPU in every rank otherwise. Where this process has not, neither does the server: an eager world
    pays for dynamo only if its ranks use it."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    preload = ["torch", "torch.distributed"]  # imported, nothing initialized
    if "torch._dynamo" in sys.modules:
        preload.append("torch._dynamo")
    context.set_forkserver_preload(preload)
    return context


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    results: Any,
    backend: str,
    environ: dict[str, str],
) -> None:
    # The fork server's environment is the one it started with: each world gets its caller's, as spawned.
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        # No rank goes on before every rank is through its init: one that got through first could otherwise
        # run a ``fn`` without collectives and exit (rank 0 taking the store with it) while a peer slowed by
        # a loaded machine is still connecting ("Connection closed by peer" / "Failed to recv" in its init).
        dist.barrier(device_ids=[rank] if backend == "nccl" else None)
        # Serialized here: tensors put on a queue as-is are shared through this process, which exits soon.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, the parent decides
        results.put((rank, False, traceback.format_exc()))
    finally:
        # The queue's feeder thread sends the result; flush it before the teardown, which can block without
        # releasing the GIL once a peer has exited (seen on torch 2.4), and would then hold the result back.
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    The processes form a ``backend`` world (gloo by default; ``nccl`` puts rank r on GPU r).
    ``fn`` must be importable (module level) and its result picklable. Raises :class:`WorkerFailed` with
    the tracebacks of failing ranks, or when the world does not finish within ``timeout`` seconds times
    :func:`timeout_scale` (the processes are then killed, so a hang fails the caller instead of blocking it).
    """
    timeout *= timeout_scale()
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    entry_args = (world_size, port, fn, args, results, backend, dict(os.environ))
    procs = [ctx.Process(target=_entry, args=(rank, *entry_args), daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while len(outcome) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                outcome[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            missing = sorted(set(range(world_size)) - set(outcome))
            dead = [r for r in missing if procs[r].exitcode not in (None, 0)]
            if _failures(outcome) and failed_at is None:  # its peers may now wait for it forever
                failed_at, deadline = time.monotonic(), min(deadline, time.monotonic() + _AFTER_A_FAILURE)
            if dead or time.monotonic() > deadline:
                why = f"died (exit codes {[procs[r].exitcode for r in dead]})" if dead else "hung"
                raise WorkerFailed(f"ranks {dead or missing} {why} without a result{_failures(outcome)}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    failures = _failures(outcome)
    if failures:
        raise WorkerFailed(failures.lstrip())
    return [torch.load(io.BytesIO(outcome[rank][1]), weights_only=False) for rank in range(world_size)]


def _failures(outcome: dict[int, tuple[bool, Any]]) -> str:
    """The tracebacks of the ranks that raised (a peer's hang often follows from them), or ''."""
    failed = {rank: value for rank, (ok, value) in outcome.items() if not ok}
    if not failed:
        return ""
    report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failed.items()))
    return f"\n{len(failed)} rank(s) failed:\n{report}"


def run_threads(
    fns: list[Callable[[], Any]], timeout: float = 30.0
) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """Run each of ``fns`` in its own thread; return (results, errors) by index.

    The in-process twin of :func:`run_world`, for replicas of one process. Raises ``AssertionError`` if a
    thread is still running after ``timeout`` seconds, so a deadlock fails the caller instead of blocking it.
    """
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def target(index: int, fn: Callable[[], Any]) -> None:
        try:
            results[index] = fn()
        except BaseException as error:  # collected for the caller to inspect
            errors[index] = error

    threads = [threading.Thread(target=target, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a thread hung"
    return results, errors


def allocations(fn: Callable[[], Any]) -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of every CPU allocation (bytes > 0) and free (bytes < 0) while ``fn()`` runs.

    From the profiler's memory events, in time order: enough to find the largest single allocation (a
    float32 copy of a half activation shows up as one) or the peak of the bytes held.
    """
    from torch.profiler import ProfilerActivity, profile

    try:  # the profiler's event tree is private: tests/test_private_apis.py checks it on each release
        from torch._C._profiler import _EventType
    except ImportError as error:
        message = f"allocations() needs torch's profiler event types, not in torch {torch.__version__}"
        raise RuntimeError(message) from error

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    nodes, events = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size))
    return sorted(events)
