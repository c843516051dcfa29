"""Every private torch (and Hydra) API distsync relies on, checked on the installed release.

distsync keeps each one behind a function with a public fallback (``distsync/_torch_compat.py``) or a guard
that falls back to torch's own behaviour (the launch agent). A release that renames or changes one of
them then takes the fallback in a user's run, slower or less informative but never wrong, and fails the
test named after it here, in CI, where it can be fixed before anyone notices.
"""

import ast
import inspect
import textwrap

import pytest
import torch
import torch.utils.checkpoint

from distsync import _torch_compat
from distsync._syncbn import checkpointing as _checkpointing
from distsync._syncbn import compiled as _compiled
from distsync.launching import agent as _launch_agent
from distsync.testing import run_world


def test_torch_disable_dynamo_is_torch_compilers_lazy_disable():
    assert callable(torch._disable_dynamo)  # _torch_compat.disable_dynamo
    wrapped = _torch_compat.disable_dynamo(lambda x: x + 1)
    assert wrapped(1) == 2


def test_dynamo_assume_constant_result_only_sets_the_flag_distsync_sets():
    import torch._dynamo

    def probe():
        return 0

    def ours():
        return 0

    marked = torch._dynamo.assume_constant_result(probe)
    flags = vars(_torch_compat.mark_constant_for_dynamo(ours))
    assert vars(marked) == flags == {"_dynamo_marked_constant": True}


@pytest.mark.skipif(not _compiled.TRACEABLE, reason="compiled.refuse runs only where the sync is traced")
@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_constant_function_learns_at_trace_time_whether_the_frame_is_one_graph(fullgraph):
    """``_torch_compat.traced_as_one_graph``, which a refusal under torch.compile reads (compiled.refuse)."""
    seen = []

    def probe() -> int:
        seen.append(_torch_compat.traced_as_one_graph())
        return 0

    _torch_compat.mark_constant_for_dynamo(probe)
    torch._dynamo.reset()  # traced anew: the other case's graph would be reused for the same code
    compiled = torch.compile(lambda x: x + probe(), fullgraph=fullgraph, backend="eager")
    assert compiled(torch.ones(1)).item() == 1
    assert seen and all(one_graph is fullgraph for one_graph in seen), seen
    assert _torch_compat.traced_as_one_graph() is False  # outside any tracing


def test_current_graph_task_id_tells_a_backward_pass():
    assert callable(torch._C._current_graph_task_id)  # _torch_compat.graph_task_id
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(_torch_compat.graph_task_id())
            return grad

    x = torch.ones(2, requires_grad=True)
    assert _torch_compat.graph_task_id() == -1
    Probe.apply(x).sum().backward()
    assert seen[0] != -1


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_regions_are_found_from_the_frames_of_both_checkpoint_modes(reentrant):
    """torch.utils.checkpoint's own frames: CheckpointFunction's forward/backward (ctx), checkpoint()'s
    generator and the unpack hook (the non-reentrant frame object): _checkpointing finds the same region
    in a forward and in its recomputation."""
    seen = []

    def region(x):
        seen.append(_checkpointing.regions())
        return x.sin()  # saves its input: recomputed in backward

    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(region, x, use_reentrant=reentrant).sum().backward()
    forward, recomputation = seen
    assert forward.replaying is None and len(forward.logging) == 1
    assert recomputation.replaying is forward.logging[0]
    assert _checkpointing.regions() is _checkpointing.OUTSIDE


def test_selective_checkpointing_modes_can_be_taken_off_the_dispatch_stack():
    """torch.utils.checkpoint's two selective-checkpointing modes, and the mode stack functions that take
    them off (and put them back) around a synchronized call's own ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    assert len(_checkpointing._SELECTIVE) == 2
    assert {mode.__name__ for mode in _checkpointing._SELECTIVE} == {
        "_CachingTorchDispatchMode",
        "_CachedTorchDispatchMode",
    }
    assert not _torch_compat.dispatch_modes_active()
    with Seen() as below, Seen() as hidden, Seen() as above:
        assert _torch_compat.dispatch_modes_active()
        with _torch_compat.without_dispatch_modes(lambda mode: mode is hidden):
            torch.ones(2).sin()
        torch.ones(2).cos()
    assert torch.ops.aten.sin.default in below.ops and torch.ops.aten.sin.default in above.ops
    assert torch.ops.aten.sin.default not in hidden.ops and torch.ops.aten.cos.default in hidden.ops


def test_module_call_frames_are_torchs_call_impl():
    """_torch_compat.modules_being_called reads the ``self`` of these two functions' frames only."""
    codes = _torch_compat.MODULE_CALL_CODES
    assert {code.co_name for code in codes} == {"_wrapped_call_impl", "_call_impl"}
    assert all(code.co_varnames[0] == "self" for code in codes)
    seen = []
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2))
    outer[0].register_forward_pre_hook(lambda module, args: seen.extend(_torch_compat.modules_being_called()))
    outer(torch.ones(1, 2))
    assert seen[0] is outer and seen[1] is outer[0]


def _broadcast_list(rank, world_size):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    before = len(ddp.modules_buffers)
    changed = _torch_compat.leave_out_of_ddp_buffer_sync(ddp, {"1.running_mean", "1.running_var"})
    return before, changed, [name for name in ddp.named_module_buffers], ddp.will_sync_module_buffers()


def test_ddp_rebuilds_its_buffer_broadcast_list_from_its_ignore_set():
    for before, changed, names, syncs in run_world(_broadcast_list, 2):
        assert (before, changed, names, syncs) == (3, True, ["1.num_batches_tracked"], True)


def test_autograd_engine_runs_callbacks_at_the_end_of_backward():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: _torch_compat.at_end_of_backward(lambda: order.append("end")) or None)
    (y * 3).sum().backward()
    order.append("returned")
    assert order == ["end", "returned"]


def _join_count(rank, world_size):
    from torch.distributed.algorithms.join import Join, Joinable, JoinHook

    class Probe(Joinable):
        def __init__(self):
            super().__init__()

        def join_hook(self, **kwargs):
            return JoinHook()

        @property
        def join_device(self):
            return torch.device("cpu")

        @property
        def join_process_group(self):
            return torch.distributed.group.WORLD

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    probe = Probe()
    with Join([probe, model]):
        work = Join.notify_join_context(probe)
        _torch_compat.give_ddp_join_count(model, work)  # DDP's reducer takes the pending count
        count = work.get_future().wait()[0].item()  # what the joinable reads
        model(torch.ones(1, 2)).sum().backward()
    return count


def test_ddp_takes_the_join_count_and_the_count_is_readable():
    assert run_world(_join_count, 2) == [2.0, 2.0]


def _timeout(rank, world_size):
    return _torch_compat.process_group_timeout(None)


def test_process_group_backend_options_hold_the_timeout():
    # ProcessGroup._get_backend(device).options._timeout: run_world's groups have a 60 s timeout
    assert run_world(_timeout, 2) == [60.0, 60.0]
    assert _torch_compat.process_group_timeout.__doc__


def test_functional_all_reduce_is_what_the_compiled_path_calls():
    from torch.distributed import _functional_collectives

    parameters = inspect.signature(_functional_collectives.all_reduce).parameters
    assert list(parameters)[:3] == ["self", "reduceOp", "group"]


def _ignored(rank, world_size):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    _torch_compat.set_ddp_ignored(model, ["1.running_mean"])
    assert _torch_compat.ddp_ignored(model) == ["1.running_mean"]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return sorted(ddp.parameters_to_ignore)


def test_ddp_honours_the_ignore_list_the_lightning_plugin_sets():
    assert run_world(_ignored, 2) == [["1.running_mean"], ["1.running_mean"]]


def test_elastic_multiprocess_context_has_what_the_launch_agent_extends():
    from torch.distributed.elastic.multiprocessing import api

    assert _launch_agent.torch_supports_watching()
    source = inspect.getsource(api)
    for name in _launch_agent.PRIVATE_ATTRIBUTES:  # set by torch's contexts, read by the watching one
        assert f"self.{name} =" in source or f"self.{name}: " in source, name
    # the log record the agent shortens into one line: its format, hence the order of its arguments
    calls = list(ast.walk(ast.parse(inspect.getsource(api.MultiprocessContext._poll).strip())))
    formats = [c.args[0].value for c in calls if isinstance(c, ast.Call) and c.args and _is_text(c.args[0])]
    assert any(f.startswith(_launch_agent.FAILED_WORKER_LOG) for f in formats), formats


def _is_text(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_profiler_event_types_that_allocations_reads():
    from torch._C._profiler import _EventType

    assert hasattr(_EventType, "Allocation")


def test_fake_tensor_mode_and_fake_process_group_of_the_trace_tool():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert callable(FakeTensorMode) and callable(FakeStore)


def test_hydra_argument_parser_that_the_training_command_reads():
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(["--cfg", "job", "a=1"])
    assert args.cfg == "job" and args.overrides == ["a=1"]


def test_the_agent_variables_a_worker_keeps_are_those_torchs_agent_sets():
    from torch.distributed.elastic.agent.server import local_elastic_agent

    from distsync.launching.worker import AGENT_VARIABLES

    source = inspect.getsource(local_elastic_agent.LocalElasticAgent._start_workers)
    tree = ast.parse(textwrap.dedent(source))
    keys = {
        key.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        for key in node.keys
        if _is_text(key) and key.value.isupper()
    }
    assert {k for k in keys if not k.startswith("TORCHELASTIC_")} <= AGENT_VARIABLES, keys


def test_omegaconf_keeps_the_composed_config_as_the_hydra_nodes_parent():
    from omegaconf import OmegaConf

    hydra_node = {"run": {"dir": "${paths.log_dir}/x"}}
    composed = OmegaConf.create({"paths": {"log_dir": "/logs"}, "hydra": hydra_node})
    masked = OmegaConf.masked_copy(composed, "hydra")
    masked.hydra._set_parent(composed)  # what HydraConfig.set_config does
    assert masked.hydra._get_parent() is composed  # what the launcher resolves the hydra node in


def test_cpython_exit_handler_functions_a_forked_worker_runs():
    import atexit

    assert callable(atexit._clear) and callable(atexit._run_exitfuncs)


def test_multiprocessing_fork_server_state_a_packed_job_shares():
    """launching.packing: a job process checks on the launcher's server by its pid (the instance's and the
    module's ``ensure_running``); launching.streams hands its fds 1 and 2 to a server's worker."""
    from multiprocessing import context, forkserver, reduction

    server = forkserver._forkserver
    for name in ("_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd"):
        assert hasattr(server, name), name
    assert callable(type(server).ensure_running) and callable(forkserver.ensure_running)
    assert callable(context.get_spawning_popen) and callable(reduction.DupFd)


def test_a_stopped_agent_stops_its_rendezvous_keep_alive_thread():
    """torch's ``launch_agent`` creates its rendezvous handler through the registry's
    ``get_rendezvous_handler`` (which ``keep_alive_stopped_on_signal`` wraps), and a c10d handler's
    keep-alive thread is its ``_keep_alive_timer``, which ``stop_keep_alive`` stops, rendezvous left open."""
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
    from torch.distributed.launcher import api

    from distsync.launching.agent import stop_keep_alive
    from distsync.testing import free_port

    assert "rdzv_registry.get_rendezvous_handler(" in inspect.getsource(api.launch_agent)
    params = RendezvousParameters(
        backend="c10d", endpoint=f"localhost:{free_port()}", run_id="keep-alive", min_nodes=1, max_nodes=1
    )
    handler = registry.get_rendezvous_handler(params)
    before = set(threading.enumerate())
    handler.next_rendezvous()
    keep_alive = [t for t in set(threading.enumerate()) - before if t.daemon]
    assert keep_alive, "no keep-alive thread started with the rendezvous"
    try:
        assert stop_keep_alive(handler, timeout=30)
        assert not any(thread.is_alive() for thread in keep_alive)
        assert not handler.is_closed()
    finally:
        handler.shutdown()
