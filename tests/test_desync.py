"""Errors decided on one rank are raised on every rank; desynchronized ranks raise, never hang."""

import torch

import distsync
from distsync.testing import run_world


def _outcome(fn):
    try:
        fn()
    except Exception as error:  # the test compares what each rank raised
        return type(error).__name__, str(error)
    return None, ""


def _layers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.BatchNorm2d(4))
    return distsync.convert_sync_batchnorm(model)


def _different_layers(rank, world_size):
    model = _layers()
    return _outcome(lambda: model[rank](torch.randn(3, 4, 2, 2)))


def _different_call_counts(rank, world_size):
    model = _layers()

    def run():
        for _ in range(1 + rank):
            model[0](torch.randn(3, 4, 2, 2))
        model[1](torch.randn(3, 4, 2, 2))

    return _outcome(run)


def _backward_against_forward(rank, world_size):
    model = _layers()

    def run():
        x = torch.randn(3, 4, 2, 2, requires_grad=True)
        out = model[0](x)
        if rank == 0:
            out.sum().backward()
        else:
            model[1](out)

    return _outcome(run)


def test_different_layers_raise_on_every_rank():
    for name, message in run_world(_different_layers, 2):
        assert name == "SyncMismatchError"
        assert "layer" in message and "'0'" in message or "'1'" in message


def test_different_call_counts_raise_on_every_rank():
    outcomes = run_world(_different_call_counts, 3)
    assert [name for name, _ in outcomes] == ["SyncMismatchError"] * 3
    assert all("disagree on layer" in message for _, message in outcomes)


def test_backward_against_forward_raises_on_every_rank():
    outcomes = run_world(_backward_against_forward, 2)
    assert [name for name, _ in outcomes] == ["SyncMismatchError"] * 2
    assert "direction" in outcomes[0][1]


def _bad_input_on_one_rank(rank, world_size, bad_shape):
    layer = distsync.DistSyncBatchNorm2d(4)
    shape = bad_shape if rank == 1 else (3, 4, 2, 2)
    first = _outcome(lambda: layer(torch.randn(shape)))
    # every rank is still in step afterwards: a valid call on all ranks works
    second = _outcome(lambda: layer(torch.randn(3, 4, 2, 2)))
    return first, second


def test_wrong_channels_on_one_rank_raise_everywhere():
    outcomes = run_world(_bad_input_on_one_rank, 3, (3, 5, 2, 2))
    names = [first[0] for first, _ in outcomes]
    assert names == ["SyncError", "ValueError", "SyncError"]
    assert "expected 4 channels" in outcomes[1][0][1]
    assert all(second == (None, "") for _, second in outcomes)


def test_wrong_rank_on_one_rank_raises_everywhere():
    outcomes = run_world(_bad_input_on_one_rank, 2, (3, 4, 2))
    assert [first[0] for first, _ in outcomes] == ["SyncError", "ValueError"]
    assert "expected 4D input" in outcomes[1][0][1]


def _single_value_globally(rank, world_size):
    layer = distsync.DistSyncBatchNorm1d(3)
    return _outcome(lambda: layer(torch.randn(1 if rank == 0 else 0, 3)))


def test_one_value_per_channel_globally_raises_on_every_rank():
    for name, message in run_world(_single_value_globally, 2):
        assert name == "ValueError"
        assert "more than 1 value per channel" in message and "got 1 over all ranks" in message


def _eps_on_one_rank(rank, world_size):
    layer = distsync.DistSyncBatchNorm2d(4, eps=0.0 if rank == 1 else 1e-5)
    first = _outcome(lambda: layer(torch.randn(3, 4, 2, 2)))
    layer.eps = 1e-5
    second = _outcome(lambda: layer(torch.randn(3, 4, 2, 2)))
    return first, second


def test_eps_on_one_rank_is_rejected_in_the_all_reduce():
    """eps <= 0 takes the bad-input path: the failed flag travels with the call, ranks stay in step."""
    outcomes = run_world(_eps_on_one_rank, 2)
    assert [first[0] for first, _ in outcomes] == ["SyncError", "ValueError"]
    assert "eps must be positive" in outcomes[1][0][1]
    assert all(second == (None, "") for _, second in outcomes)


def _different_widths(rank, world_size, widths):
    layer = distsync.DistSyncBatchNorm1d(widths[rank])
    return _outcome(lambda: layer(torch.randn(3, widths[rank])))


def test_desync_between_layers_of_different_widths_raises_instead_of_aborting():
    """Payloads come in size classes, so out-of-step layers of 4 and 64 channels meet equal sizes."""
    for outcome in run_world(_different_widths, 2, (4, 64), timeout=60):
        assert outcome[0] == "SyncMismatchError" and "layer" in outcome[1], outcome
