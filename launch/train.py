"""Train the small DistSyncBatchNorm CNN; configured by Hydra, run as a torchrun world.

    python launch/train.py                                   # 2 local workers, digits, sync BN
    torchrun --nproc_per_node=2 launch/train.py trainer.max_steps=100
    python launch/train.py -m optim.lr=0.1,0.05 trainer.max_steps=50

See docs/training.md for every option.
"""

import hydra
from omegaconf import DictConfig

from distsync.train import hydra_app  # registers the config schema


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    return hydra_app.hydra_main(cfg)


if __name__ == "__main__":
    hydra_app.prepare_argv()
    main()
