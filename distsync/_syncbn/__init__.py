"""How a call of a synchronized layer runs (private): the modules behind ``DistSyncBatchNorm``'s forward.

``subclass`` makes the twin of a user's batch-norm subclass; ``identity`` names each layer and call;
``fx`` and ``checkpointing`` keep tracing and recomputation right; ``kernels`` (CUDA kernels, the CPU's
shifted input, generic ops) and ``sums`` make the local moments; ``moments`` merges them into the payload
and reads the reduced one; ``transport`` all-reduces it over the process group; ``compiled`` is the
traceable forward used under ``torch.compile``; ``health`` keeps the deferred verdicts behind
``distsync.check_sync``; ``unwrapped`` warns of a model no data-parallel wrapper calls; ``trace`` runs the
CUDA path on fake tensors. See docs/architecture.md.
"""
