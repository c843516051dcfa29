"""Hydra launcher plugin: every job of a ``-m`` sweep runs as its own torchrun world (see ``launcher``)."""
