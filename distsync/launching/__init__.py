"""The launch layer: a function or Hydra app run as a torchrun world, and sweeps packed onto devices.

``elastic`` is :func:`distsync.launch` (an elastic agent in this process, workers forked or spawned from it);
``agent`` holds what it adds to torch's agent (watching ranks, naming failures); ``worker`` is what each rank
runs before the user's function (the config, the rank in the environment, the result back); ``packing`` runs
several worlds at once on disjoint slots, each job's console lines tagged by ``tagged_output``;
``device_split`` splits GPUs or cores into those slots; ``lifeline`` makes a worker die with its parent;
``rendezvous`` gives every multi-node job a store of its own (the run id in the store), which
``slurm_rendezvous`` finds under SLURM (the first node, a port of the job's own that no other run holds);
``fork_server`` keeps the workers' fork server alive through a SIGTERM sent to the whole job;
``rank_fork_server`` makes what a rank's own fork server forks (its DataLoader workers) die with the rank. The
Hydra plugin (``hydra_plugins/distsync_torchrun_launcher``) and the packaged job (``distsync.train``) build on
it. See docs/architecture.md.
"""

from distsync.launching.device_split import DeviceSet, split_devices
from distsync.launching.elastic import LaunchError, launch
from distsync.launching.worker import NonRetryableError

__all__ = ["DeviceSet", "LaunchError", "NonRetryableError", "launch", "split_devices"]
