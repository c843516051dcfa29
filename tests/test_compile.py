"""torch.compile(fullgraph=True) on models with synchronized layers: one graph, equal to eager mode.

On torch releases whose compiler cannot trace the synchronized call (``_compiled.TRACEABLE`` is False), a
compiled model runs each synchronized call eagerly between graphs: the same results, and fullgraph=True
refuses the model instead of compiling something else.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bn_subclasses import ActNorm2d
from torch import nn

import distsync
from distsync._syncbn import compiled as _compiled
from distsync.testing import run_world

FULLGRAPH = _compiled.TRACEABLE


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        distsync.DistSyncBatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3),
        distsync.DistSyncBatchNorm2d(4, momentum=None),
        distsync.convert_sync_batchnorm(ActNorm2d(4)),  # a converted subclass: its forward traced too
    )


def _compiled_vs_eager(rank, world_size, steps):
    eager, compiled_model = _model(0), _model(0)
    compiled = torch.compile(compiled_model, fullgraph=FULLGRAPH, backend="aot_eager")
    worst = {}

    def note(name, a, b):
        scale = max(b.abs().max().item(), 1.0)
        worst[name] = max(worst.get(name, 0.0), (a - b).abs().max().item() / scale)

    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        last = step == steps - 1  # an epoch's last batch is smaller: recompiled for a dynamic batch size
        x = torch.randn(3 + rank - last, 3, 8, 8, generator=gen) * 2 + 1
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_c = eager(xe), compiled(xc)
        dy = torch.randn(out_e.shape, generator=gen)
        (out_e * dy).sum().backward()
        (out_c * dy).sum().backward()
        distsync.check_sync()
        note("output", out_c, out_e)
        note("input grad", xc.grad, xe.grad)
        for (name, pe), pc in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
            note(f"{name} grad", pc.grad, pe.grad)
        for (name, be), bc in zip(eager.named_buffers(), compiled_model.buffers(), strict=True):
            note(name, bc.double(), be.double())
    counts = torch._dynamo.utils.counters["stats"]
    return worst, counts["unique_graphs"]


def test_fullgraph_compile_equals_eager():
    """Item 8: no graph break (fullgraph would raise at any), outputs, gradients and running statistics
    (num_batches_tracked included) equal to eager mode's over several steps, the last with a smaller batch."""
    for worst, graphs in run_world(_compiled_vs_eager, 2, 3):
        assert max(worst.values()) < 1e-5, worst
        assert graphs >= 2 or not FULLGRAPH  # the smaller batch's graph too


def _compiled_out_of_step(rank, world_size):
    model = nn.Sequential(distsync.DistSyncBatchNorm1d(4), distsync.DistSyncBatchNorm1d(4))
    first, second = (torch.compile(layer, fullgraph=FULLGRAPH, backend="aot_eager") for layer in model)
    try:
        for step in range(3):
            layer = second if (rank == 1 and step == 1) else first
            layer(torch.randn(5, 4)).sum().backward()
        distsync.check_sync()
    except distsync.SyncMismatchError as error:
        return str(error)
    return None


def test_compiled_calls_are_checked_by_check_sync_on_every_rank():
    """Verdicts are not read in the graph: check_sync() raises the out-of-step call on every rank (the
    call itself, where the synchronized calls run eagerly)."""
    for message in run_world(_compiled_out_of_step, 2):
        assert message is not None and "out of step" in message


def _compiled_rejected_input(rank, world_size, fullgraph):
    layer = torch.compile(distsync.DistSyncBatchNorm2d(4), fullgraph=fullgraph, backend="aot_eager")
    layer(torch.randn(3, 4, 2, 2))
    try:
        layer(torch.randn(3, 3 if rank == 1 else 4, 2, 2))  # rank 1: a batch of 3 channels
        distsync.check_sync()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


@pytest.mark.parametrize("fullgraph", [True, False] if FULLGRAPH else [False])
def test_a_rank_whose_compiled_call_rejects_its_input_fails_it_on_every_rank(fullgraph):
    """The rank that rejects its input raises the problem (at trace time: shapes are static there; under
    ``fullgraph=True`` inside dynamo's error) after taking part in the call's all-reduce with its failure
    flagged, so that its peer's compiled call holds the failure and ``check_sync()`` raises it there: no
    peer waits for an all-reduce nobody makes."""
    (peer_kind, peer_message), (kind, message) = run_world(_compiled_rejected_input, 2, fullgraph)
    assert "expected 4 channels in dimension 1" in message, message
    if not fullgraph:  # under fullgraph: dynamo's own error, quoting the ValueError
        assert kind == "ValueError", kind
    assert peer_kind == "SyncError", peer_message
    assert "1 other participant(s) rejected their input" in peer_message, peer_message
    assert "forward call #1" in peer_message, peer_message


def _eager_after_a_fullgraph_refusal(rank, world_size):
    plain = distsync.DistSyncBatchNorm2d(4)
    compiled = torch.compile(plain, fullgraph=True, backend="aot_eager")
    compiled(torch.randn(3, 4, 2, 2))
    outcomes = []
    for call in (compiled, plain):  # rank 1 rejects its input: compiled whole, then eagerly
        try:
            call(torch.randn(3, 3 if rank == 1 else 4, 2, 2))
            distsync.check_sync()
            outcomes.append(None)
        except Exception as error:
            outcomes.append((type(error).__name__, str(error)))
    return outcomes


@pytest.mark.skipif(not FULLGRAPH, reason="this torch cannot compile the synchronized call whole")
def test_an_eager_call_after_a_fullgraph_refusal_fails_on_every_rank_again():
    """Under ``fullgraph=True`` no eager rerun follows a refusal: the rank's next eager call with a rejected
    input still takes part in its all-reduce, so the peer raises again instead of waiting for it."""
    peer, rejecting = run_world(_eager_after_a_fullgraph_refusal, 2, timeout=90)
    for kind, message in peer:  # the eager call's error was "Connection closed by peer" once rank 1 exited
        assert kind == "SyncError" and "1 other participant(s) rejected their input" in message, message
    kind, message = rejecting[1]
    assert kind == "ValueError" and "expected 4 channels in dimension 1" in message, message


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = distsync.DistSyncBatchNorm2d(4), distsync.DistSyncBatchNorm2d(4)
        self.narrow = False  # the second layer gets 3 of the 4 channels

    def forward(self, x):
        x = self.first(x)
        return self.second(x[:, :3] if self.narrow else x)


def _compiled_rejected_deeper(rank, world_size):
    model = _TwoLayers()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(3, 4, 2, 2))
    model.narrow = rank == 1
    try:
        compiled(torch.randn(3, 4, 2, 2))
        distsync.check_sync()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


def test_a_compiled_call_rejected_deeper_in_the_graph_still_fails_on_every_rank():
    """Rejected at the graph's second synchronized call: the refusal's all-reduce meets the peer's first
    call (the rejecting rank has not run its graph yet), so the peer's ``check_sync()`` raises that call out
    of step, saying a participant had rejected its input; the rejecting rank raises the problem. An error
    on both, no wait. (Where the compiler cannot trace the sync, each call runs eagerly: the peer raises
    the rejection itself.)"""
    (peer_kind, peer_message), (kind, message) = run_world(_compiled_rejected_deeper, 2)
    assert kind == "ValueError" and "'second'" in message and "expected 4 channels" in message, message
    if FULLGRAPH:
        assert peer_kind == "SyncMismatchError" and "'first'" in peer_message, peer_message
        assert "1 of them had rejected their input" in peer_message, peer_message
    else:
        assert peer_kind == "SyncError" and "rejected their input at 'second'" in peer_message, peer_message


def _nan_statistics(rank, world_size):
    torch.manual_seed(0)
    batches = [torch.randn(4, 3, 2, 2) for _ in range(world_size)]
    batches[1][0, 1, 0, 0] = float("nan")  # channel 1's statistics are NaN; the others are not
    reference = nn.BatchNorm2d(3).double()
    reference(torch.cat(batches).double())
    layer = distsync.DistSyncBatchNorm2d(3)
    torch.compile(layer, fullgraph=FULLGRAPH, backend="aot_eager")(batches[rank])
    return [(b.double(), r) for b, r in zip(layer.buffers(), reference.buffers(), strict=True)]


def test_compiled_running_statistics_take_a_nan_as_batchnorm_does():
    """A NaN in one rank's batch makes that channel's running statistics NaN, as in ``nn.BatchNorm2d`` on
    the whole batch (and in eager mode); the other channels move as there."""
    for buffers in run_world(_nan_statistics, 2):
        for ours, reference in buffers:
            assert torch.equal(ours.isnan(), reference.isnan()), (ours, reference)
            torch.testing.assert_close(ours.nan_to_num(), reference.nan_to_num().to(ours.dtype))


def test_fullgraph_compile_with_inductor():
    """Inductor's generated kernels, forward and backward, equal eager mode."""
    worst, _ = run_world(_with_inductor, 2)[0]
    assert max(worst.values()) < 1e-4, worst


def _with_inductor(rank, world_size):
    eager, compiled_model = _model(0), _model(0)
    compiled = torch.compile(compiled_model, fullgraph=FULLGRAPH, backend="inductor")
    x = torch.randn(3 + rank, 3, 8, 8) + 2
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_c = eager(xe), compiled(xc)
    # A random upstream gradient: square().sum() makes the last layer's input gradient cancel to rounding
    # noise, which the generated backward and the eager kernels round differently.
    dy = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(rank))
    (out_e * dy).sum().backward()
    (out_c * dy).sum().backward()
    worst = {"output": (out_c - out_e).abs().max().item()}
    worst["input grad"] = (xc.grad - xe.grad).abs().max().item()
    for (name, pe), pc in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        worst[f"{name} grad"] = ((pc.grad - pe.grad).norm() / pe.grad.norm()).item()
    for (name, be), bc in zip(eager.named_buffers(), compiled_model.buffers(), strict=True):
        worst[name] = (bc.double() - be.double()).abs().max().item()
    return worst, None


def _trains_without_dynamo(rank, world_size):
    import sys

    layer = distsync.DistSyncBatchNorm2d(4)
    layer(torch.randn(3, 4, 2, 2, requires_grad=True)).sum().backward()
    distsync.check_sync()
    return "torch._dynamo" in sys.modules


def test_eager_training_never_imports_dynamo():
    """Importing dynamo costs seconds in every rank: only compiling may do it.

    The world starts from a fresh interpreter: this process's fork server may have been started (by a
    launch test run in the same process before) with dynamo among its preloaded libraries."""
    code = "import test_compile as m, distsync.testing as t; print(t.run_world(m._trains_without_dynamo, 2))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[False, False]"


def _fullgraph_refused(rank, world_size):
    compiled = torch.compile(_model(0), fullgraph=True, backend="aot_eager")
    try:
        compiled(torch.randn(3, 3, 8, 8))
    except Exception as error:  # dynamo's own error for a graph break under fullgraph
        return type(error).__name__
    return None


@pytest.mark.skipif(FULLGRAPH, reason="this torch traces the synchronized call whole")
def test_a_release_that_cannot_trace_the_sync_refuses_fullgraph():
    assert None not in run_world(_fullgraph_refused, 2)


# ------------------------------------------------------------------ torch.export and torch.jit.trace


def _plain_model():
    torch.manual_seed(0)
    # momentum=None: no export of nn.BatchNorm's own (it divides by num_batches_tracked read on the host)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.BatchNorm2d(8, affine=False))


def _captured(kind: str, model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``model`` as ``torch.jit.trace`` records it or ``torch.export`` exports it (strict or not)."""
    if kind == "jit.trace":
        return torch.jit.trace(model, (x,), check_trace=False)
    return torch.export.export(model, (x,), strict=kind == "export").module()


_CAPTURES = ("jit.trace", "export", "export non-strict")


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # nn.BatchNorm's own, traced in training
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.trace's (2.13)
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("kind", _CAPTURES)
def test_traced_or_exported_without_a_process_group_is_batchnorm(kind, mode):
    """Deployment code traces or exports a model as it is. Without a process group the layers are
    ``nn.BatchNorm``: the captured model computes what the plain one does, and in training mode moves the
    running statistics as it does (non-strict export on torch < 2.11 once recursed until Python's limit)."""
    if kind == "export" and mode == "train" and not FULLGRAPH:
        pytest.skip("strict export refuses the graph break this torch's compiler makes at each sync")
    plain = getattr(_plain_model(), mode)()
    converted = getattr(distsync.convert_sync_batchnorm(_plain_model()), mode)()
    x, y = torch.randn(4, 3, 8, 8) + 2, torch.randn(4, 3, 8, 8) * 3 - 1  # exports fix the shape
    captured, reference = _captured(kind, converted, x), _captured(kind, plain, x)
    torch.testing.assert_close(captured(y), reference(y), rtol=1e-5, atol=1e-5)
    if mode == "train":  # eval mode moves no buffer
        own = dict(captured.named_buffers())
        for name, expected in reference.named_buffers():
            torch.testing.assert_close(own[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def _exported_and_traced(rank, world_size):
    """What each capture of a converted model gives on this rank: its training-mode output and buffers beside
    nn.BatchNorm's on the full batch, its eval-mode output beside the plain model's, or its error."""
    generators = [torch.Generator().manual_seed(r) for r in range(world_size)]
    batches = [torch.randn(3 + r, 3, 8, 8, generator=g) * 2 + r for r, g in enumerate(generators)]
    x = batches[rank]
    rows = slice(sum(len(b) for b in batches[:rank]), sum(len(b) for b in batches[: rank + 1]))
    reference = _plain_model()
    expected = reference(torch.cat(batches))[rows]
    eval_expected = _plain_model().eval()(x)
    seen = {}
    for kind in _CAPTURES:
        model = distsync.convert_sync_batchnorm(_plain_model())
        layer = model[1]
        try:
            captured = _captured(kind, model, x)
        except Exception as error:  # every rank makes the same capture: each raises alike, before a sync
            seen[kind, "train"] = (type(error).__name__, str(error), list(layer._sync_state.calls))
        else:
            output = captured(x)
            worst = (output - expected).abs().max().item()
            own = dict(captured.named_buffers())
            for name, buffer in reference.named_buffers():
                worst = max(worst, (own[name].double() - buffer.double()).abs().max().item())
            seen[kind, "train"] = worst
        model = distsync.convert_sync_batchnorm(_plain_model()).eval()
        seen[kind, "eval"] = (_captured(kind, model, x)(x) - eval_expected).abs().max().item()
    # after a refused trace the model trains as before: the same calls on every rank, in step
    model = distsync.convert_sync_batchnorm(_plain_model())
    with pytest.raises(RuntimeError):
        torch.jit.trace(model, (x,), check_trace=False)
    seen["after"] = (model(x) - expected).abs().max().item()
    distsync.check_sync()
    return seen


def test_export_captures_the_synced_call_and_jit_trace_refuses_it_on_every_rank():
    """In a 2-rank world: ``torch.export`` captures the synchronized training call whole where torch's
    compiler traces it (the full batch's outputs and running statistics), and raises on every rank where it
    cannot; ``torch.jit.trace``, which would freeze the call's Python statistics into constants, raises on
    every rank before any sync, saying to trace in eval mode, where either captures ``nn.BatchNorm``."""
    for seen in run_world(_exported_and_traced, 2):
        for kind in _CAPTURES:
            assert seen[kind, "eval"] < 1e-5, (kind, seen)
            train = seen[kind, "train"]
            if kind == "jit.trace":
                name, message, calls = train
                assert name == "RuntimeError" and "torch.jit.trace cannot record" in message, train
                assert "model.eval()" in message and calls == [0, 0], train
            elif FULLGRAPH:
                assert isinstance(train, float) and train < 1e-5, (kind, seen)
            else:
                assert isinstance(train, tuple) and train[2] == [0, 0], (kind, train)
                if kind == "export non-strict":
                    assert "torch.export cannot capture" in train[1], train
        assert seen["after"] < 1e-5, seen
