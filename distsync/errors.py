"""Errors raised identically on every rank of a synchronized layer."""


class SyncError(RuntimeError):
    """A synchronized collective could not produce a valid result on every rank.

    Raised on every participating rank alike, because it is decided from all-reduced values.
    """


class SyncMismatchError(SyncError):
    """Ranks reached a synchronized batch norm collective from different layers, calls or directions.

    Typical causes are data-dependent branches that call different BN layers on different ranks, call the
    same layer a different number of times, or send one rank into backward while another still runs forward.
    """
