"""The training job's Hydra configs, shipped inside the package (see docs/training.md)."""
