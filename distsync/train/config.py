"""Training configuration: plain dataclasses with defaults and validation, no Hydra.

Hydra registers these classes as the schema of ``conf/`` (see :mod:`distsync.train.hydra_app`); workers
receive a resolved :class:`TrainConfig` instance, which pickles like any dataclass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional  # noqa: UP035  (OmegaConf reads these annotations)

__all__ = ["ConfigError", "ModelConfig", "DataConfig", "OptimConfig", "TrainerConfig", "TrainConfig"]

NORMS = ("sync", "local", "torch")
PRECISIONS = ("32", "bf16", "fp16")
Node = Dict[str, Any]  # noqa: UP006  a ``_target_`` node (distsync.train.targets); empty: not used
DATASETS = ("digits", "synthetic")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "constant")
METRICS = ("accuracy", "final_loss", "eval_loss")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
BACKENDS = ("auto", "gloo", "nccl")  # the job runs on CPUs with gloo or on one GPU per process with nccl


def _node(key: str, node) -> None:
    if node:
        _require(isinstance(node.get("_target_"), str), key, "must be a node with a _target_", node)


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the dotted key."""


def _require(ok: bool, key: str, message: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key} {message} (got {value!r})")


def _one_of(key: str, value, choices: tuple) -> None:
    _require(value in choices, key, f"must be one of {', '.join(choices)}", value)


def _at_least(group: str, config, strict: bool = False, **lows) -> None:
    """Each named field of ``config`` is ``>= low`` (``> low`` with ``strict``); the error names the key."""
    for name, low in lows.items():
        value = getattr(config, name)
        ok = value > low if strict else value >= low
        _require(ok, f"{group}.{name}", f"must be {'>' if strict else '>='} {low}", value)


@dataclass
class ModelConfig:
    """The small CNN: conv-BN-ReLU blocks, global average pooling, one linear classifier."""

    name: str = "cnn"
    """``cnn`` (the small CNN below), or any name for the model ``factory`` builds (logs and summary)."""
    factory: Node = field(default_factory=dict)
    """A ``_target_`` node that builds the model instead: any importable callable and its keyword
    arguments (``{_target_: torchvision.models.resnet18, num_classes: 10}``)."""
    loss: Node = field(default_factory=dict)
    """A ``_target_`` node for the loss module (``{_target_: torch.nn.CrossEntropyLoss, label_smoothing:
    0.1}``); default: cross-entropy."""
    channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    """Output channels of each conv block; blocks after the first start with a 2x2 max pool."""
    norm: str = "sync"
    """``sync``: DistSyncBatchNorm; ``local``: per-rank nn.BatchNorm2d; ``torch``: nn.SyncBatchNorm (CUDA)."""
    dropout: float = 0.0
    """Dropout before the classifier."""

    def __post_init__(self) -> None:
        if not self.factory:
            _one_of("model.name", self.name, ("cnn",))
        _node("model.factory", self.factory)
        _node("model.loss", self.loss)
        _one_of("model.norm", self.norm, NORMS)
        _require(len(self.channels) >= 1, "model.channels", "must list at least one width", self.channels)
        _require(all(c >= 1 for c in self.channels), "model.channels", "must be positive", self.channels)
        _require(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)", self.dropout)


@dataclass
class DataConfig:
    """Dataset and per-rank batch size. ``digits`` is scikit-learn's bundled 8x8 digits (no download)."""

    name: str = "digits"
    """``digits`` (1797 real 8x8 images, 10 classes) or ``synthetic`` (class templates plus noise)."""
    batch_size: int = 32
    """Samples per rank per step; the global batch is ``batch_size * world_size``."""
    test_fraction: float = 0.2
    """Held-out share of the samples, split stratified with ``split_seed``."""
    split_seed: int = 0
    """Seed of the train/test split (and of the synthetic data)."""
    num_samples: int = 2000
    """Synthetic only: number of images."""
    num_classes: int = 10
    """Synthetic only: number of classes."""
    image_size: int = 8
    """Synthetic only: height and width."""
    noise: float = 1.0
    """Synthetic only: standard deviation of the noise added to the class template."""
    train: Node = field(default_factory=dict)
    """A ``_target_`` node for a map-style training dataset of ``(image, label)`` pairs instead of the
    built-in data (``torchvision.datasets.ImageFolder``, ``FakeData``, yours); needs ``test`` too."""
    test: Node = field(default_factory=dict)
    """The held-out dataset's ``_target_`` node, with ``train``."""
    num_workers: Optional[int] = None  # noqa: UP045
    """DataLoader worker processes per rank, for ``train``/``test`` datasets. Default (null): one fewer
    than the cores per rank (the cores of the host over the ranks on it), at most 8; 0 with 1 core."""

    def __post_init__(self) -> None:
        if not self.train:
            _one_of("data.name", self.name, DATASETS)
        _node("data.train", self.train)
        _node("data.test", self.test)
        _require(bool(self.train) == bool(self.test), "data.test", "goes with data.train", self.test)
        workers = self.num_workers
        _require(workers is None or workers >= 0, "data.num_workers", "must be >= 0 (or null)", workers)
        _at_least("data", self, batch_size=1, num_samples=2, num_classes=2, noise=0)
        _require(0 < self.test_fraction < 1, "data.test_fraction", "must be in (0, 1)", self.test_fraction)
        _require(2 <= self.image_size <= 512, "data.image_size", "must be in [2, 512]", self.image_size)


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "sgd"
    """``sgd`` (with Nesterov momentum) or ``adamw``."""
    lr: float = 0.1
    """Peak learning rate."""
    momentum: float = 0.9
    """SGD momentum (ignored by AdamW)."""
    weight_decay: float = 5e-4
    """Weight decay."""
    schedule: str = "cosine"
    """``cosine`` decay to zero at ``trainer.max_steps``, or ``constant``."""
    warmup_steps: int = 0
    """Linear warm-up steps before the schedule."""
    factory: Node = field(default_factory=dict)
    """A ``_target_`` node for another optimizer, called with the model's parameters first
    (``{_target_: torch.optim.RMSprop, alpha: 0.9}``); ``lr`` is ``optim.lr`` unless the node sets it."""
    scheduler: Node = field(default_factory=dict)
    """A ``_target_`` node for the LR scheduler, called with the optimizer first and stepped every
    optimizer step; replaces ``schedule`` and ``warmup_steps``."""

    def __post_init__(self) -> None:
        if not self.factory:
            _one_of("optim.name", self.name, OPTIMIZERS)
        _node("optim.factory", self.factory)
        _node("optim.scheduler", self.scheduler)
        _one_of("optim.schedule", self.schedule, SCHEDULES)
        _at_least("optim", self, strict=True, lr=0)
        _at_least("optim", self, weight_decay=0, warmup_steps=0)
        _require(0.0 <= self.momentum < 1.0, "optim.momentum", "must be in [0, 1)", self.momentum)


@dataclass
class TrainerConfig:
    """World size, length of the run, fault tolerance, logging and DDP options."""

    nproc_per_node: int = 2
    """Worker processes per node (one GPU each where CUDA exists)."""
    nnodes: int = 1
    """Nodes in the world; > 1 needs ``rdzv_endpoint`` (or SLURM, see docs/training.md)."""
    max_steps: int = 1000
    """Optimizer steps of the whole run (a resumed run does only the remaining ones)."""
    max_restarts: int = 3
    """How often the elastic agent restarts the world after a worker failure."""
    checkpoint_every: int = 250
    """Rank 0 writes a checkpoint every this many steps, and always at the end."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept in ``<run_dir>/checkpoints``."""
    log_every: int = 25
    """Steps between metric lines (loss reduced across ranks)."""
    eval_every: int = 250
    """Steps between held-out evaluations; there is always one at the end."""
    precise_bn_batches: int = 0
    """Before each held-out evaluation, set the synced BN statistics to those of this many training batches
    per rank (``distsync.update_bn``, precise BN); 0: off."""
    seed: int = 0
    """Seed of the model init and the sampler; each rank's RNG is seeded with ``seed + rank``."""
    backend: str = "auto"
    """``auto`` (nccl with CUDA, else gloo), ``gloo`` (CPU) or ``nccl`` (one GPU per process)."""
    timeout_s: float = 300.0
    """Collective timeout in seconds."""
    metric: str = "accuracy"
    """Summary field returned to Hydra (the value sweepers optimize)."""
    progress: bool = True
    """Progress bar on rank 0 when stderr is a terminal; plain log lines otherwise."""
    monitor_interval: float = 0.1
    """Seconds between the elastic agent's health checks of its workers."""
    rdzv_endpoint: str = ""
    """``host:port`` of the c10d rendezvous; empty: localhost on a free port (single node)."""
    rdzv_id: str = ""
    """Run id shared by the nodes of one job; empty: a fresh id (or the SLURM job id)."""
    comm_hook: str = "none"
    """DDP gradient communication hook: ``none``, ``fp16``/``bf16`` compression or ``powersgd``."""
    powersgd_rank: int = 2
    """Matrix rank of the PowerSGD approximation."""
    local_sgd_period: int = 0
    """Post-local-SGD: after ``local_sgd_warmup`` steps, average models every this many steps (0: off)."""
    local_sgd_warmup: int = 100
    """Steps of ordinary DDP before post-local-SGD starts."""
    precision: str = "32"
    """``32``, or autocast to ``bf16`` / ``fp16`` (fp16 on CUDA, with a gradient scaler)."""
    channels_last: bool = False
    """Model and inputs in the channels-last memory format."""
    grad_accum_steps: int = 1
    """Micro-batches of ``data.batch_size`` per optimizer step (DDP syncs gradients on the last one)."""
    grad_clip: float = 0.0
    """Clip the gradients' global norm to this value before each optimizer step (0: off)."""
    compile: bool = False
    """``torch.compile`` the model for training."""

    def __post_init__(self) -> None:
        _at_least("trainer", self, nproc_per_node=1, nnodes=1)
        # Rank r seeds NumPy with seed + r, which must stay below 2^32.
        _require(0 <= self.seed < 2**32 - 2**16, "trainer.seed", "must be in [0, 2^32 - 2^16)", self.seed)
        _at_least("trainer", self, max_steps=1, max_restarts=0, checkpoint_every=1, keep_checkpoints=1)
        _at_least("trainer", self, log_every=1, eval_every=1, precise_bn_batches=0, grad_accum_steps=1)
        _at_least("trainer", self, grad_clip=0, powersgd_rank=1, local_sgd_period=0, local_sgd_warmup=1)
        _at_least("trainer", self, strict=True, timeout_s=0, monitor_interval=0)
        _one_of("trainer.backend", self.backend, BACKENDS)
        _one_of("trainer.metric", self.metric, METRICS)
        _one_of("trainer.comm_hook", self.comm_hook, COMM_HOOKS)
        _one_of("trainer.precision", self.precision, PRECISIONS)
        if self.rdzv_endpoint:
            _require(
                ":" in self.rdzv_endpoint, "trainer.rdzv_endpoint", "must be host:port", self.rdzv_endpoint
            )


@dataclass
class TrainConfig:
    """A whole training run: the four groups of ``conf/``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        for group in (self.model, self.data, self.optim, self.trainer):
            for item in fields(group):
                value = getattr(group, item.name)
                if isinstance(value, float):
                    _require(
                        math.isfinite(value), f"{_GROUPS[type(group)]}.{item.name}", "must be finite", value
                    )
        if self.trainer.local_sgd_period and self.trainer.comm_hook not in ("none",):
            raise ConfigError(
                f"trainer.local_sgd_period cannot be combined with trainer.comm_hook={self.trainer.comm_hook}"
            )


_GROUPS = {ModelConfig: "model", DataConfig: "data", OptimConfig: "optim", TrainerConfig: "trainer"}
