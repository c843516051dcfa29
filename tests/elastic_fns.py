"""Module-level functions for distsync.launch tests (workers import them by name)."""

from __future__ import annotations

import os


def rank_and_config(cfg):
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg


def fail_on_rank_one(cfg):
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one refuses")
    return "fine"
