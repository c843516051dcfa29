"""Layer identity and the desync check's arithmetic, without a world: paths and exactness bounds."""

import copy
import io

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import distsync
from distsync._syncbn.identity import layer_hash, layer_path
from distsync._syncbn.payload import (
    CALL,
    IDENTITY,
    MAX_WORLD_SIZE,
    SQUARES,
    TAIL,
    SyncState,
    call_modulus,
    payload_size,
    verdict,
)
from distsync.testing import run_world


def _model():
    return distsync.convert_sync_batchnorm(
        nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4)))
    )


def _paths(model: nn.Module, root: nn.Module | None = None) -> list[str]:
    return [layer_path(m) for m in (root or model).modules() if isinstance(m, distsync.DistSyncBatchNorm)]


def _reload(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # no module-registration records in this process


def test_paths_are_the_same_for_built_loaded_copied_and_wrapped_models():
    built = _model()
    assert _paths(built) == ["1", "2.0"]
    assert _paths(_reload(built)) == ["1", "2.0"]
    assert _paths(copy.deepcopy(built)) == ["1", "2.0"]
    # Wrappers (DataParallel's ``module`` here, like DDP's) are left out, around a built or a loaded model.
    assert _paths(nn.DataParallel(_model())) == ["1", "2.0"]
    assert _paths(nn.DataParallel(_reload(built))) == ["1", "2.0"]
    # Paths are stamped by the conversion: registering the model in an outer module later changes nothing.
    outer, loaded_outer = nn.Module(), nn.Module()
    outer.net, loaded_outer.net = _model(), _reload(built)
    assert _paths(outer) == _paths(loaded_outer) == ["1", "2.0"]
    # A plain model loaded, then converted: the new layers are named from the loaded root.
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)))
    assert _paths(distsync.convert_sync_batchnorm(_reload(plain))) == ["1.1"]
    # Converted from the root, directly called submodules are named from the root, so they are told apart.
    model = distsync.convert_sync_batchnorm(_EncoderDecoder())
    assert layer_path(model.encoder[1]) == "encoder.1" and layer_path(model.decoder[1]) == "decoder.1"
    loaded = _reload(model)
    assert layer_path(loaded.encoder[1]) == "encoder.1" and layer_path(loaded.decoder[1]) == "decoder.1"


class _BuiltSynced(nn.Module):
    """A model built with synchronized layers (never converted): paths come from its first call."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(4, 4, 1), distsync.DistSyncBatchNorm2d(4))
        self.decoder = nn.Sequential(nn.Conv2d(4, 4, 1), distsync.DistSyncBatchNorm2d(4))

    def forward(self, x, first="encoder"):
        parts = (self.encoder, self.decoder) if first == "encoder" else (self.decoder, self.encoder)
        return parts[1](parts[0](x))


def _path_at_call(root: nn.Module, layer: nn.Module) -> str:
    """The path ``layer`` resolves when ``root(x)`` calls it (read by a pre-hook, inside the call)."""
    seen = []
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(layer_path(module)))
    root(torch.randn(3, 4, 2, 2))
    handle.remove()
    return seen[0]


def test_built_models_are_named_from_the_outermost_module_at_their_first_call():
    model = _BuiltSynced()
    assert model.encoder[1]._sync_state.path is None
    assert _path_at_call(nn.DataParallel(model), model.decoder[1]) == "decoder.1"  # wrapper slot left out
    assert model.encoder[1]._sync_state.path == "encoder.1"  # every layer under that root at once
    alone = distsync.DistSyncBatchNorm2d(4)
    assert _path_at_call(alone, alone) == f"#{alone._sync_state.built}"  # called on its own
    converted = distsync.convert_sync_batchnorm(_BuiltSynced())  # conversion names built layers too
    assert layer_path(converted.decoder[1]) == "decoder.1"


def test_a_layer_called_on_its_own_is_named_by_the_order_it_was_built_in():
    """``model[2][0](x)`` in a loop, on a model never converted nor called whole: no module being called
    holds it, and no heap is scanned for one, so it is named ``#k``, the k-th synchronized layer built in
    this process (two layers of one width never share a name); a later conversion names it by its path."""
    model = nn.Sequential(nn.Conv2d(4, 4, 1), distsync.DistSyncBatchNorm2d(4))
    model.append(nn.Sequential(distsync.DistSyncBatchNorm2d(4)))
    first, second = model[1]._sync_state.built, model[2][0]._sync_state.built
    assert second == first + 1
    assert layer_path(model[2][0]) == f"#{second}" and layer_path(model[1]) == f"#{first}"
    assert model[1]._sync_state.path is None  # not stamped: the model called whole names it by its path
    assert _path_at_call(model, model[2][0]) == "2.0"
    copy = _reload(distsync.DistSyncBatchNorm2d(4))
    assert layer_path(copy) == f"#{copy._sync_state.built}" and copy._sync_state.built > second


def test_frames_are_read_in_torch_compat_only():
    """The only frame reads are torch's module-call and checkpoint frames, in ``_torch_compat``; nothing
    scans the heap."""
    import re
    from pathlib import Path

    root = Path(distsync.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        if path.name != "_torch_compat.py":
            assert not re.search(r"\b(_getframe|f_back|f_locals)\b", text), path
        assert not re.search(r"\bgc\.get_(objects|referrers)\b", text), path


def test_importing_distsync_changes_nothing_in_torch():
    import subprocess
    import sys

    probe = (
        "import torch, torch.nn.modules.module as m\n"
        "hooks = lambda: {k: repr(getattr(m, k)) for k in dir(m) if k.startswith('_global_')}\n"
        "before = hooks()\n"
        "import distsync\n"
        "after = hooks()\n"
        "assert before == after, (before, after)\n"
        "assert torch.nn.BatchNorm2d.__module__ == 'torch.nn.modules.batchnorm'\n"
        "print('unchanged', len(after))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("unchanged"), result.stderr


def test_renumbered_and_named_layers():
    model = _model()
    del model[0]  # nn.Sequential renumbers its modules in place: the names stamped by conversion stay
    assert _paths(model) == ["1", "2.0"]
    assert _paths(distsync.convert_sync_batchnorm(model)) == ["0", "1.0"]  # until it is converted again
    twin = distsync.name_layers(_model(), "teacher")
    assert _paths(twin) == ["teacher.1", "teacher.2.0"]
    assert _paths(_reload(twin)) == _paths(copy.deepcopy(twin)) == ["teacher.1", "teacher.2.0"]
    assert _paths(distsync.name_layers(nn.DataParallel(_model()), "t")) == ["t.1", "t.2.0"]
    with pytest.raises(ValueError, match="non-empty string"):
        distsync.name_layers(twin, "")


def test_layer_ids_are_64_bit_and_do_not_collide_where_crc32_did():
    # crc32 modulo 2^20, the earlier id, gave these two the same id at width 8.
    assert layer_hash("bn3380", 8) != layer_hash("bn40040", 8)
    ids = {layer_hash(f"layer{i}.bn", 64) for i in range(10_000)}
    assert len(ids) == 10_000 and max(ids) >= 2**60
    state = SyncState()
    state.identity = layer_hash("bn3380", 8)
    row = state.tail(state.next_tag(0), 2, True, torch.device("cpu"), 8)
    assert row.numel() == payload_size(8) - 2 * 8 and not row[:-TAIL].any()
    row = row[-TAIL:]
    digits = row[IDENTITY.start : IDENTITY.start + 4].long().tolist()
    assert sum(d * 2 ** (20 * i) for i, d in enumerate(digits)) == state.identity


def _reduced_verdict(calls: torch.Tensor, layer: float, world_size: int):
    """The verdict of a call whose participants sent ``calls`` as their call count and ``layer`` as id."""
    tails = torch.zeros(world_size, TAIL, dtype=torch.float64)
    tails[:, IDENTITY.start] = layer
    tails[:, SQUARES.start] = layer * layer
    tails[:, CALL] = calls
    tails[:, SQUARES.start + CALL - IDENTITY.start] = calls * calls
    return verdict(tails.sum(0).tolist(), world_size)


@pytest.mark.parametrize("world_size", [2, 3, 1000, MAX_WORLD_SIZE])
def test_desync_check_is_exact_up_to_the_largest_world_it_accepts(world_size):
    modulus = call_modulus(world_size)
    assert modulus >= 64 and 3 * (world_size * modulus) ** 2 < 2**53
    largest = float(modulus - 1)  # the hardest values: the largest ids and call counts a tail can hold
    calls = torch.full((world_size,), largest, dtype=torch.float64)
    assert _reduced_verdict(calls, largest, world_size).disagreeing == ()
    calls[world_size // 2] -= 1  # one participant one call behind
    assert _reduced_verdict(calls, largest, world_size).disagreeing == ("call count",)


def test_worlds_above_the_exact_bound_are_refused_clearly():
    with pytest.raises(ValueError, match=f"at most {MAX_WORLD_SIZE} participants"):
        call_modulus(MAX_WORLD_SIZE + 1)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's imports
def test_compile_wrapper_is_left_out():
    assert _paths(torch.compile(_model())) == ["1", "2.0"]


class _EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
        self.decoder = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))


def _outcome(fn):
    try:
        return None, fn()
    except Exception as error:  # the test compares what each rank raised
        return type(error).__name__, str(error)


def _x():
    return torch.randn(3, 4, 2, 2)


def _identity_world(rank, world_size, saved):
    import gc
    import weakref

    seen = {}
    # Built on rank 1, loaded whole on rank 0; submodules called directly (feature extraction).
    model = torch.load(io.BytesIO(saved), weights_only=False) if rank == 0 else _built()
    seen["loaded, direct calls"] = _outcome(lambda: model.encoder[1](model.encoder[0](_x())).shape)
    # A wrapper on one rank only.
    wrapped = nn.DataParallel(_built()) if rank == 0 else _built()
    inner = wrapped.module if rank == 0 else wrapped
    seen["wrapper on one rank"] = _outcome(lambda: inner.encoder(_x()).shape)
    # Direct submodule calls in swapped order: layers at path '1' of one width in both.
    swapped = _built()
    order = (swapped.encoder, swapped.decoder) if rank == 0 else (swapped.decoder, swapped.encoder)
    seen["swapped submodules"] = _outcome(lambda: [part(_x()) for part in order] and None)
    # Layer names whose ids collided under crc32 mod 2^20.
    holder = nn.Module()
    holder.bn3380, holder.bn40040 = distsync.DistSyncBatchNorm2d(8), distsync.DistSyncBatchNorm2d(8)
    distsync.convert_sync_batchnorm(holder)  # names the built layers from the holder
    layer = holder.bn3380 if rank == 0 else holder.bn40040
    seen["colliding names"] = _outcome(lambda: layer(torch.randn(3, 8, 2, 2)).shape)
    # Separately built twins called in rank-dependent order: named, they are told apart.
    twins = [distsync.name_layers(_built(), name) for name in ("a", "b")]
    seen["named twins swapped"] = _outcome(lambda: twins[rank].encoder(_x()).shape)
    # A model built with synchronized layers, never converted: named from the model at the first call,
    # so its parts called in rank-dependent order inside its forward are told apart.
    built = _BuiltSynced()
    seen["built, swapped inside forward"] = _outcome(lambda: built(_x(), ("encoder", "decoder")[rank]).shape)
    # Layers of one width called on their own, never converted nor called under a model: named by the
    # order they were built in, the same on every rank.
    alone = [distsync.DistSyncBatchNorm2d(4), distsync.DistSyncBatchNorm2d(4)]
    seen["built, called alone"] = _outcome(lambda: [layer(_x()) for layer in alone][-1].shape)
    alone = [distsync.DistSyncBatchNorm2d(4), distsync.DistSyncBatchNorm2d(4)]
    seen["built, called alone, swapped"] = _outcome(lambda: [layer(_x()) for layer in alone[:: 1 - 2 * rank]])
    # A layer shared by two parents, a checkpointed block and functional_call: every rank alike.
    shared = _built()
    shared.decoder[1] = shared.encoder[1]

    def shared_and_checkpointed():
        x = _x().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(shared.decoder, shared.encoder(x), use_reentrant=False)
        y.sum().backward()
        params = {name: p.detach() * 2 for name, p in shared.encoder.named_parameters()}
        return torch.func.functional_call(shared.encoder, params, (_x(),)).shape

    seen["shared, checkpoint, functional"] = _outcome(shared_and_checkpointed)
    # The first batch is not kept alive by the layer (no caller frames read).
    fresh = _built()
    batch = _x()
    ref = weakref.ref(batch)
    fresh.encoder(batch).sum()
    del batch
    gc.collect()
    seen["first batch freed"] = ref() is None
    return seen


def _built():
    torch.manual_seed(0)
    return distsync.convert_sync_batchnorm(_EncoderDecoder())


def test_identity_across_ranks():
    buffer = io.BytesIO()
    torch.save(_built(), buffer)
    for seen in run_world(_identity_world, 2, buffer.getvalue()):
        ok = ("loaded, direct calls", "wrapper on one rank", "shared, checkpoint, functional")
        for scenario in (*ok, "built, called alone"):
            assert seen[scenario] == (None, torch.Size([3, 4, 2, 2])), (scenario, seen[scenario])
        swapped = ("swapped submodules", "colliding names", "named twins swapped")
        for scenario in (*swapped, "built, swapped inside forward", "built, called alone, swapped"):
            assert seen[scenario][0] == "SyncMismatchError", (scenario, seen[scenario])
        assert seen["first batch freed"]


def _training_loop(rank, world_size, wrapped):
    """A training loop that goes on after its first step, around a model built with synchronized layers
    (named at their first call) with or without DDP (the unwrapped-model warning looks at the callers)."""
    import gc
    import warnings
    import weakref

    from torch.nn.parallel import DistributedDataParallel

    model = _BuiltSynced()
    forward = DistributedDataParallel(model) if wrapped else model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            batch = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(rank)).requires_grad_()
            if step == 0:
                first = weakref.ref(batch)
            forward(batch).sum().backward()
            del batch
            gc.collect()
            if step == 0:
                freed = first() is None  # the loop is still running: nothing of its frame may be kept
    warned = any("no data-parallel wrapper" in str(w.message) for w in caught)
    return freed, model.encoder[1]._sync_state.path, model.decoder[1]._sync_state.path, warned


@pytest.mark.parametrize("wrapped", [False, True], ids=["unwrapped", "DDP"])
def test_the_first_call_keeps_nothing_of_the_callers_alive(wrapped):
    """The first synchronized call names the layers from the modules being called and looks for a
    data-parallel wrapper; neither keeps the training loop's first batch alive."""
    for freed, encoder, decoder, warned in run_world(_training_loop, 2, wrapped):
        assert freed
        assert (encoder, decoder) == ("encoder.1", "decoder.1")
        assert warned is not wrapped
