"""Data-parallel training of a small CNN with :class:`distsync.DistSyncBatchNorm`, launched by torchrun.

The package has no Hydra dependency except :mod:`distsync.train.hydra_app`, which registers the config
schema and starts the elastic launches; :func:`run` is the worker every rank executes.
"""

from distsync.train.build import SmallCNN, build_model
from distsync.train.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    TrainerConfig,
)
from distsync.train.rank_process import run

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "SmallCNN",
    "TrainConfig",
    "TrainerConfig",
    "build_model",
    "run",
]
