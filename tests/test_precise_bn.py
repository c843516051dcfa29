"""distsync.update_bn: the statistics of all the data every rank saw, exact and identical on every rank."""

import dataclasses

import pytest
import torch
from torch import nn

import distsync
from distsync.testing import run_world


def _model(norm=nn.BatchNorm2d):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), norm(4), nn.ReLU(), nn.Conv2d(4, 5, 1), norm(5, momentum=None))


def _loader(rank, counts, size=3):
    """Rank ``rank``'s batches: ``counts[rank]`` of them, of differing sizes, far from zero mean."""
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(size + i, 3, 5, 5, generator=gen) * (1 + rank) + 4 for i in range(counts[rank])]


def _expected(counts, num_batches=None):
    """float64 plain BN in training mode on each step's global batch; the pooled statistics of each BN
    layer's inputs over every step."""
    model = _model().double()
    loaders = [_loader(r, counts) for r in range(len(counts))]
    steps = max(counts) if num_batches is None else min(max(counts), num_batches)
    inputs = {1: [], 4: []}
    hooks = [model[i].register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0])) for i in inputs]
    for step in range(steps):
        model(torch.cat([loader[step] for loader in loaders if step < len(loader)]).double())
    for hook in hooks:
        hook.remove()
    stats = {}
    for i, xs in inputs.items():
        x = torch.cat([t.transpose(0, 1).reshape(t.shape[1], -1) for t in xs], dim=1)
        stats[i] = (x.mean(1), x.var(1))
    return stats


def _update(rank, world_size, counts, num_batches=None, compiled=False):
    model = distsync.convert_sync_batchnorm(_model())
    model[2].eval()  # a flag update_bn must leave as it found it
    before = [p.clone() for p in model.parameters()], model[1].num_batches_tracked.clone()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    distsync.update_bn(_loader(rank, counts), run, num_batches=num_batches)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[0], strict=True))
    assert torch.equal(model[1].num_batches_tracked, before[1]) and model[4].momentum is None
    assert model.training and not model[2].training
    return {i: (model[i].running_mean, model[i].running_var) for i in (1, 4)}


@pytest.mark.parametrize(
    "counts, num_batches, compiled",
    [([3, 1], None, False), ([2, 0, 3], None, False), ([4, 3], 2, False), ([3, 1], None, True)],
    ids=["2-ranks-uneven", "3-ranks-one-empty-loader", "batch-limit", "compiled-model"],
)
def test_update_bn_pools_every_rank_exactly_and_identically(counts, num_batches, compiled):
    """Also for a ``torch.compile``d model: the statistics each synchronized call sees are recorded at every
    run of the graph, not once while it was traced (the empty batches of a rank that ran out included)."""
    expected = _expected(counts, num_batches)
    results = run_world(_update, len(counts), counts, num_batches, compiled)
    for result in results:
        for i, (mean, var) in expected.items():
            torch.testing.assert_close(result[i][0].double(), mean, rtol=2e-6, atol=2e-6)
            torch.testing.assert_close(result[i][1].double(), var, rtol=2e-6, atol=2e-6)
            assert torch.equal(result[i][0], results[0][i][0]) and torch.equal(result[i][1], results[0][i][1])


def test_update_bn_in_one_process():
    expected = _expected([3])
    result = _update(0, 1, [3])
    for i, (mean, var) in expected.items():
        torch.testing.assert_close(result[i][0].double(), mean, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(result[i][1].double(), var, rtol=2e-6, atol=2e-6)


def test_running_averages_are_not_what_update_bn_computes():
    """The test above can fail: the momentum-averaged running statistics differ from the pooled ones."""
    model = _model()
    for x in _loader(0, [3]):
        model(x)
    assert not torch.allclose(model[1].running_var.double(), _expected([3])[1][1], rtol=1e-3)


class _FailingLoader:
    def __iter__(self):
        yield torch.randn(2, 3, 5, 5)
        raise OSError("disk gone")


def _one_loader_fails(rank, world_size):
    model = distsync.convert_sync_batchnorm(_model())
    loader = _FailingLoader() if rank == 1 else _loader(rank, [3, 3])
    try:
        distsync.update_bn(loader, model)
    except (OSError, distsync.SyncError) as error:
        return type(error).__name__
    return None


def test_a_failing_loader_raises_on_every_rank():
    assert run_world(_one_loader_fails, 2, timeout=120) == ["SyncError", "OSError"]


@dataclasses.dataclass
class _Batch:
    image: torch.Tensor
    label: torch.Tensor
    source: str = "train"


class _Taking(nn.Module):
    """The model of the tests above, called on a batch of another form."""

    def __init__(self, form):
        super().__init__()
        self.net, self.form = _model(), form

    def forward(self, batch):
        if self.form == "dict":
            image = batch["image"]
        elif self.form == "dataclass":
            image = batch.image
        else:  # a list of inputs: the image and a mask of its shape
            image = batch[0] * batch[1]
        return self.net(image)


def _in_form(x, form):
    label = torch.zeros(x.shape[0], dtype=torch.long)
    if form == "dict":
        return {"image": x, "label": label, "source": "train"}
    if form == "dataclass":
        return _Batch(x, label)
    if form == "list of inputs":  # the model's input is itself a list
        return [[x, torch.ones_like(x)], label]
    return (x, label) if form == "tuple" else [x, label]


def _update_in_form(rank, world_size, counts, form):
    model = distsync.convert_sync_batchnorm(
        _Taking(form) if form in ("dict", "dataclass", "list of inputs") else _model()
    )
    distsync.update_bn([_in_form(x, form) for x in _loader(rank, counts)], model)
    net = getattr(model, "net", model)
    return {i: (net[i].running_mean, net[i].running_var) for i in (1, 4)}


@pytest.mark.parametrize("form", ["list", "tuple", "dict", "dataclass", "list of inputs"])
@pytest.mark.parametrize("counts", [[3, 1], [2, 0, 3]], ids=["uneven", "one-empty-loader"])
def test_update_bn_takes_batches_of_any_form_with_uneven_counts(form, counts):
    """The ranks that ran out call the model on an empty batch of the same form as the others'."""
    expected = _expected(counts)
    for result in run_world(_update_in_form, len(counts), counts, form):
        for i, (mean, var) in expected.items():
            torch.testing.assert_close(result[i][0].double(), mean, rtol=2e-6, atol=2e-6)
            torch.testing.assert_close(result[i][1].double(), var, rtol=2e-6, atol=2e-6)
