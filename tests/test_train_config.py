"""The Hydra config tree in conf/ against the dataclass schema of distsync.train.config."""

from __future__ import annotations

import pickle

import pytest
from hydra import compose, initialize

from distsync.train import ConfigError, TrainConfig, TrainerConfig
from distsync.train.hydra_app import to_train_config


def _compose(*overrides: str) -> TrainConfig:
    with initialize(version_base="1.3", config_path="../conf"):
        return to_train_config(compose("config", overrides=list(overrides)))


def test_defaults_match_the_dataclasses():
    cfg = _compose()
    assert cfg == TrainConfig()
    assert cfg.trainer.nproc_per_node == 2
    assert cfg.model.norm == "sync"
    assert cfg.data.name == "digits"


def test_required_keys_exist():
    cfg = _compose()
    for key in [
        "trainer.nproc_per_node",
        "trainer.max_steps",
        "trainer.max_restarts",
        "trainer.checkpoint_every",
        "trainer.seed",
        "optim.lr",
        "data.batch_size",
        "model.norm",
    ]:
        group, name = key.split(".")
        assert hasattr(getattr(cfg, group), name), key


def test_groups_and_overrides():
    cfg = _compose("data=synthetic", "optim=adamw", "trainer=fast", "model.norm=local", "optim.lr=0.01")
    assert cfg.data.name == "synthetic"
    assert (cfg.optim.name, cfg.optim.lr) == ("adamw", 0.01)
    assert cfg.trainer.max_steps == 20
    assert cfg.model.norm == "local"


def test_resolved_config_is_a_picklable_dataclass():
    cfg = _compose("model.channels=[8,16]")
    assert type(cfg) is TrainConfig and type(cfg.trainer) is TrainerConfig
    assert cfg.model.channels == [8, 16] and type(cfg.model.channels) is list
    assert pickle.loads(pickle.dumps(cfg)) == cfg


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.nproc_per_node=0", "trainer.nproc_per_node"),
        ("trainer.max_steps=-1", "trainer.max_steps"),
        ("trainer.max_restarts=-2", "trainer.max_restarts"),
        ("trainer.checkpoint_every=0", "trainer.checkpoint_every"),
        ("data.batch_size=0", "data.batch_size"),
        ("optim.lr=0", "optim.lr"),
        ("model.norm=group", "model.norm"),
        ("data.name=mnist", "data.name"),
        ("trainer.comm_hook=int8", "trainer.comm_hook"),
        ("trainer.max_steps=???", "trainer.max_steps"),
    ],
)
def test_invalid_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _compose(override)


def test_type_errors_are_caught_at_compose_time():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="nproc_per_node"):
        _compose("trainer.nproc_per_node=abc")


def test_dataclasses_validate_without_hydra():
    with pytest.raises(ConfigError, match=r"trainer\.nproc_per_node must be >= 1"):
        TrainerConfig(nproc_per_node=0)


@pytest.mark.parametrize(("override", "key"), [("+trainer.foo=1", "trainer.foo"), ("+bogus=3", "bogus")])
def test_unknown_keys_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: not a key of the training config$"):
        _compose(override)


@pytest.mark.parametrize("override", ["optim.lr=inf", "data.noise=inf", "trainer.timeout_s=inf"])
def test_non_finite_values_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key} must be finite"):
        _compose(override)


def test_backends_this_machine_cannot_run_are_refused_before_launch(monkeypatch):
    import torch

    from distsync.train.hydra_app import _check_environment

    for backend in ("foo", "mpi", "ucc", "fake"):  # mpi & co. failed only inside the workers, 3 times
        refusal = f"trainer.backend must be one of auto, gloo, nccl \\(got '{backend}'\\)"
        with pytest.raises(ConfigError, match=refusal):
            _check_environment(_compose(f"trainer.backend={backend}"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.backend=nccl needs CUDA GPUs"):
        _check_environment(_compose("trainer.backend=nccl"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="trainer.nproc_per_node=2 but this node has 1 GPU"):
        _check_environment(_compose("trainer.backend=nccl"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.batch_size=100000"], r"^data.batch_size must be at most 719 \(.*1438 training samples"),
        (["data.test_fraction=0.999"], r"^data.test_fraction=0.999 leaves 0 training samples"),
        (["data=synthetic", "data.num_samples=2"], r"^data.test_fraction=0.2 leaves no held-out samples"),
        (
            ["data=synthetic", "data.num_samples=20", "data.batch_size=9"],
            r"^data.batch_size must be at most 8",
        ),
        (["trainer.seed=-1"], r"^trainer.seed must be in"),
        (["data.image_size=100000"], r"^data.image_size must be in \[2, 512\]"),
    ],
)
def test_data_and_seed_errors_are_found_before_any_worker_starts(overrides, message):
    from distsync.train.hydra_app import _check_environment

    with pytest.raises(ConfigError, match=message):
        _check_environment(_compose(*overrides))
