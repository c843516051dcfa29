"""``distsync.devices``, the documented path of the device split: see
:mod:`distsync.launching.device_split`."""

from distsync.launching.device_split import *  # noqa: F403
from distsync.launching.device_split import __all__  # noqa: F401
