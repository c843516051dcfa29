"""A Lightning + Hydra project in the shape of the lightning-hydra-template, trained through distsync.

    python train.py trainer=ddp_cpu_or_gpu +plugin=distsync                 # Lightning's own DDP, synced BN
    python train.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 trainer=ddp_cpu_or_gpu \\
        +plugin=distsync model.lr=0.001,0.003                               # each job a 2-rank world
    python train.py -m hparams_search=optuna hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 \\
        hydra.launcher.n_jobs=2 trainer=ddp_cpu_or_gpu +plugin=distsync     # an Optuna search, packed
    python train.py launch_nproc=2 trainer=ddp_cpu_or_gpu +plugin=distsync   # distsync.launch in main

Used by tests/test_lightning_template.py. Like the template, the entry is a thin ``@hydra.main`` around a
plain ``train(cfg)``; ``extras`` and the ranked logger are rank-zero-only.
"""

import os
from pathlib import Path

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from template.utils import RankedLogger, extras, instantiate_callbacks

import distsync

# what the template's rootutils does
os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))
log = RankedLogger(__name__, rank_zero_only=True)


def train(cfg: DictConfig) -> float:
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    trainer = hydra.utils.instantiate(cfg.trainer, plugins=instantiate_callbacks(cfg.get("plugin")))
    log.info(f"fitting job {HydraConfig.get().job.name} in {HydraConfig.get().runtime.output_dir}")
    trainer.fit(model, datamodule=datamodule)
    return float(trainer.callback_metrics["val/acc"])


@hydra.main(version_base="1.3", config_path="configs", config_name="train.yaml")
def main(cfg: DictConfig) -> float:
    extras(cfg)
    if cfg.launch_nproc:  # the one-line face: this job's world started from here
        return distsync.launch(train, cfg, nproc_per_node=cfg.launch_nproc)
    return train(cfg)


if __name__ == "__main__":
    main()
