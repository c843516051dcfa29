"""The template's rank-zero-only helpers: ``extras`` (config tree, tags file) and a ranked logger."""

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from lightning_utilities.core.rank_zero import rank_prefixed_message, rank_zero_only
from omegaconf import DictConfig, OmegaConf


class RankedLogger(logging.LoggerAdapter):
    """A logger that prefixes the rank, and logs on rank 0 alone with ``rank_zero_only=True``."""

    def __init__(self, name: str = __name__, rank_zero_only: bool = False) -> None:
        super().__init__(logger=logging.getLogger(name), extra=None)
        self.rank_zero_only = rank_zero_only

    def log(self, level: int, msg: str, *args, **kwargs) -> None:
        if self.isEnabledFor(level):
            rank = getattr(rank_zero_only, "rank", None)
            msg, kwargs = self.process(rank_prefixed_message(msg, rank), kwargs)
            if not self.rank_zero_only or rank == 0:
                self.logger.log(level, msg, *args, **kwargs)


@rank_zero_only
def extras(cfg: DictConfig) -> None:
    """The config tree and the tags, written once per run (rank 0), as the template's ``extras`` does."""
    output = Path(HydraConfig.get().runtime.output_dir)
    with open(output / "config_tree.log", "a") as file:
        file.write(OmegaConf.to_yaml(cfg))
    with open(output / "tags.log", "a") as file:
        file.write(f"{list(cfg.get('tags', []))}\n")


def instantiate_callbacks(node) -> list:
    """The plugins of ``node`` (a dict of ``_target_`` nodes, or None)."""
    return [hydra.utils.instantiate(spec) for spec in (node or {}).values()]
