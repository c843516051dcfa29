"""``distsync.devices``, the documented path of the device split: see :mod:`distsync.launching.devices`."""

from distsync.launching.devices import *  # noqa: F403
from distsync.launching.devices import __all__  # noqa: F401
