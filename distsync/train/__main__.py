"""``python -m distsync.train``: the packaged training job (``distsync-train``), also under an external
torchrun without a checkout::

    torchrun --nproc_per_node=2 -m distsync.train trainer.max_steps=100
"""

from distsync.train.hydra_app import main

if __name__ == "__main__":
    main()
