"""Errors decided on one rank are raised on every rank; desynchronized ranks raise, never hang."""

from functools import partial

import pytest
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


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _dtype_pairs(rank, world_size):
    """Every (input, layer) dtype pair on both ranks, against nn.BatchNorm2d; then a float64 layer on rank 1
    only, and the same call once both layers are float32 again."""
    pairs = {}
    for input_dtype in _DTYPES:
        for layer_dtype in _DTYPES:
            x = torch.randn(3, 4, 2, 2).to(input_dtype)
            synced = distsync.DistSyncBatchNorm2d(4).to(layer_dtype)
            local = torch.nn.BatchNorm2d(4).to(layer_dtype)
            outcomes = _outcome(partial(synced, x)), _outcome(partial(local, x))
            pairs[str(input_dtype), str(layer_dtype)] = outcomes
    layer = distsync.DistSyncBatchNorm2d(4).to(torch.float64 if rank == 1 else torch.float32)
    first = _outcome(lambda: layer(torch.randn(3, 4, 2, 2)))
    layer.float()
    second = _outcome(lambda: layer(torch.randn(3, 4, 2, 2)))
    return pairs, first, second


def test_parameters_of_another_dtype_than_the_input_are_refused_as_nn_batchnorm_refuses_them():
    """Each pair nn.BatchNorm's kernels refuse (float64 input into a float32 layer, ...) raises ValueError
    naming the dtypes on every rank, in training as in eval mode, instead of computing with converted
    parameters; those it takes (a float16 or bfloat16 input into a float32 layer) are taken."""
    outcomes = run_world(_dtype_pairs, 2)
    for pairs, _, _ in outcomes:
        refused = [pair for pair, (synced, local) in pairs.items() if local[0] is not None]
        assert ("torch.float64", "torch.float32") in refused and len(refused) < len(pairs) - len(_DTYPES)
        for pair, (synced, local) in pairs.items():
            if local[0] is None:
                assert synced == (None, ""), pair
            else:
                assert synced[0] == "ValueError" and "dtype" in synced[1], (pair, synced)
    assert [first[0] for _, first, _ in outcomes] == ["SyncError", "ValueError"]
    assert "torch.float64" in outcomes[1][1][1] and "torch.float32" in outcomes[1][1][1]
    assert all(second == (None, "") for _, _, second in outcomes)


def _different_widths(rank, world_size, widths):
    layer = distsync.DistSyncBatchNorm1d(widths[rank])
    return _outcome(lambda: layer(torch.randn(3, widths[rank])))


def test_desync_between_layers_of_different_widths_raises_instead_of_aborting():
    """Payloads come in size classes, so out-of-step layers of 4 and 64 channels meet equal sizes."""
    for outcome in run_world(_different_widths, 2, (4, 64), timeout=60):
        assert outcome[0] == "SyncMismatchError" and "layer" in outcome[1], outcome


# --- DDP's default buffer broadcast between synchronized calls -------------------------------------------


class _Parent(torch.nn.Module):
    """A parent whose child alone was converted: DDP wraps the parent."""

    def __init__(self, child):
        super().__init__()
        self.child = child
        self.head = torch.nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.child(x))


def _ddp_model(model_form):
    torch.manual_seed(0)
    if model_form == "built":  # DistSyncBatchNorm in the model itself, never converted
        layers = [distsync.DistSyncBatchNorm2d(4), torch.nn.Conv2d(4, 4, 1), distsync.DistSyncBatchNorm2d(4)]
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), *layers)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4)
    )
    if model_form == "parent":
        return _Parent(distsync.convert_sync_batchnorm(model))
    return distsync.convert_sync_batchnorm(model)


def _wrap(model, ddp_form):
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ddp_form == "migration guide":  # docs/migration.md's snippet on the CPU
        return DDP(model, device_ids=None)
    # DDP(model) with its defaults: what Ray Train's prepare_model builds on the CPU
    return DDP(model)


def _extra_call_under_default_ddp(rank, world_size, ddp_form, model_form):
    import datetime

    torch.distributed.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=20))  # a hang fails fast
    model = _ddp_model(model_form)
    ddp = _wrap(model, ddp_form)
    layers = [m for m in model.modules() if isinstance(m, distsync.DistSyncBatchNorm)]

    def train():
        for step in range(3):
            x = torch.randn(2 + rank, 3, 4, 4, generator=torch.Generator().manual_seed(rank + 10 * step))
            ddp(x).square().sum().backward()
            if rank == 0 and step == 1:  # after DDP's own once-only collective (its buckets, at step 1)
                layers[-1](torch.randn(3, 4, 2, 2))  # one synchronized call more than rank 1

    return _outcome(train)


@pytest.mark.parametrize(
    "ddp_form, model_form",
    [("defaults", "converted"), ("migration guide", "built"), ("defaults", "parent")],
    ids=["DDP(model)-converted", "migration-snippet-built", "DDP(parent of converted)"],
)
def test_an_extra_call_under_default_ddp_raises_on_every_rank(ddp_form, model_form):
    """DDP's buffer broadcast before each forward (on by default, as in Ray Train's prepare_model) would
    meet the extra call's all-reduce on the other rank: both would wait for the timeout. The synchronized
    layers' statistics are left out of it, so the next call tells the ranks apart at once."""
    outcomes = run_world(_extra_call_under_default_ddp, 2, ddp_form, model_form, timeout=120)
    for name, message in outcomes:
        assert name == "SyncMismatchError", message


def _broadcast_buffers(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _ddp_model("converted")
    model.register_buffer("scale", torch.ones(()))  # a buffer of the model's own: DDP broadcasts it
    ddp = DDP(model)
    for _ in range(2):
        ddp(torch.randn(3, 3, 4, 4)).sum().backward()
        with torch.no_grad():  # what a broadcast would hide: rank-local values, set between steps
            model.scale.fill_(rank + 1.0)
            model[1].running_mean.fill_(rank + 1.0)
    ddp(torch.randn(3, 3, 4, 4))
    return model.scale.item(), model[1].running_mean[0].item() - 0.9 * (rank + 1.0)  # momentum 0.1


def test_default_ddp_broadcasts_other_buffers_but_not_the_synchronized_statistics():
    (scale0, moved0), (scale1, moved1) = run_world(_broadcast_buffers, 2)
    assert scale0 == scale1 == 1.0  # rank 0's, broadcast before the last forward
    assert moved0 == pytest.approx(moved1)  # each rank's own value, moved alike by the synchronized call


# Groups of 2 and 1 under DDP's defaults: what leaves DDP's broadcast must not depend on the size of a rank's
# group, or DDP's buffer lists differ between ranks and its broadcast meets a collective of another kind.
UNEQUAL_GROUPS = ([0, 1], [2])
UNEQUAL_SIZES = (2, 3, 4)  # per-rank batch sizes


def _unequal_batch(rank, step):
    generator = torch.Generator().manual_seed(rank + 10 * step)
    return (torch.randn(UNEQUAL_SIZES[rank], 4, 3, 3, generator=generator, dtype=torch.float64) + rank,
            torch.randn(UNEQUAL_SIZES[rank], 4, 3, 3, generator=generator, dtype=torch.float64))  # fmt: skip


def _plain_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4, momentum=None)
    ).double()


def _unequal_groups_under_default_ddp(rank, world_size, extra_call):
    """Three steps of DDP(model) with its defaults, groups [0, 1] and [2]; every rank also trains the plain
    float64 model on each group's whole batch and returns how far its own layers are from it."""
    import copy
    import datetime

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.distributed.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=20))  # a hang fails fast
    group, _ = torch.distributed.new_subgroups_by_enumeration(UNEQUAL_GROUPS)
    references = [_plain_net() for _ in UNEQUAL_GROUPS]
    model = distsync.convert_sync_batchnorm(copy.deepcopy(references[0]), process_group=group)
    ddp = DDP(model)
    mine = next(g for g, ranks in enumerate(UNEQUAL_GROUPS) if rank in ranks)
    distance = 0.0

    def far(a, b):
        return (a - b).abs().max().item()

    def train():
        nonlocal distance
        for step in range(3):
            x, dy = _unequal_batch(rank, step)
            x.requires_grad_()
            out = ddp(x)
            out.backward(dy)
            grads = []
            for reference, ranks in zip(references, UNEQUAL_GROUPS, strict=True):
                batches = [_unequal_batch(r, step) for r in ranks]
                ref_x = torch.cat([b[0] for b in batches]).requires_grad_()
                ref_out = reference(ref_x)
                ref_out.backward(torch.cat([b[1] for b in batches]))
                grads.append([p.grad for p in reference.parameters()])
                if reference is references[mine]:
                    start = sum(UNEQUAL_SIZES[r] for r in ranks if r < rank)
                    rows = slice(start, start + UNEQUAL_SIZES[rank])
                    distance = max(distance, far(out, ref_out[rows]), far(x.grad, ref_x.grad[rows]))
            averaged = [sum(g) / world_size for g in zip(*grads, strict=True)]  # DDP's mean over its world
            for p, g in zip(model.parameters(), averaged, strict=True):
                distance = max(distance, far(p.grad, g))
            with torch.no_grad():  # one SGD step, the same for the model and the references
                for module in (model, *references):
                    for p, g in zip(module.parameters(), averaged, strict=True):
                        p -= 0.1 * g
            for module in (model, *references):
                module.zero_grad()
            if extra_call and rank == 0 and step == 1:  # after DDP's own once-only collective (its buckets)
                model[-1](torch.randn(3, 4, 2, 2, dtype=torch.float64))  # one synchronized call more than 1
        for name, buffer in model.named_buffers():
            distance = max(distance, far(buffer.double(), references[mine].get_buffer(name).double()))

    outcome = _outcome(train)
    return outcome, distance


def test_unequal_groups_train_under_default_ddp_as_batch_norm_on_each_groups_batch():
    """The rank alone in its group leaves its layers' statistics out of DDP's broadcast as the others do:
    the same buffer lists on every rank, so nothing hangs, and each layer keeps its own group's statistics
    (for the group of one, its own batch's) instead of rank 0's."""
    for rank, (outcome, distance) in enumerate(run_world(_unequal_groups_under_default_ddp, 3, False)):
        assert outcome == (None, ""), (rank, outcome)
        assert distance < 1e-10, (rank, distance)


def test_an_extra_call_beside_a_group_of_one_under_default_ddp_raises_in_its_group():
    """Rank 0 makes one synchronized call more than rank 1: both raise SyncMismatchError at rank 1's next
    call, not a gloo timeout; rank 2, alone in its group, then fails in DDP's next collective, as its peers
    have left it."""
    outcomes = run_world(_unequal_groups_under_default_ddp, 3, True)
    for rank in UNEQUAL_GROUPS[0]:
        assert outcomes[rank][0][0] == "SyncMismatchError", outcomes[rank]
    assert outcomes[2][0][0] is not None  # its peers left DDP's next collective: it raises, it does not hang
