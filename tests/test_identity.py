"""Layer identity and the desync check's arithmetic, without a world: paths and exactness bounds."""

import copy
import io

import pytest
import torch
from torch import nn

from distsync._identity import CALL, IDENTITY, MAX_WORLD_SIZE, SQUARES, TAIL, call_modulus, layer_path
from distsync._moments import verdict


def _paths_seen_in_forward(model: nn.Module) -> list[str]:
    """The path each BatchNorm layer finds for itself while ``model`` runs (as a syncing layer would)."""
    seen = []
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.register_forward_pre_hook(lambda module, args: seen.append(layer_path(module)))
    model(torch.randn(2, 3, 4, 4))
    return seen


def _model():
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4)))


def test_paths_are_the_same_for_built_loaded_copied_and_wrapped_models():
    built = _model()
    buffer = io.BytesIO()
    torch.save(built, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # no module-registration records in this process
    wrapper = nn.Module()
    wrapper.module = copy.deepcopy(built)  # what DDP does, around a copy
    assert _paths_seen_in_forward(built) == ["1", "2.0"]
    assert _paths_seen_in_forward(loaded) == ["1", "2.0"]
    assert _paths_seen_in_forward(copy.deepcopy(built)) == ["1", "2.0"]
    seen = []
    wrapper.module[1].register_forward_pre_hook(lambda module, args: seen.append(layer_path(module)))
    wrapper.forward = lambda x: wrapper.module(x)
    wrapper(torch.randn(2, 3, 4, 4))
    assert seen == ["module.1"]


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
