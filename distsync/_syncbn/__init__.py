"""How a call of a synchronized layer runs (private): the modules behind ``DistSyncBatchNorm``'s forward.

``kernels`` holds each device's passes over the activation (CUDA's batch-norm kernels, the CPU's shifted
input and blocked sums, generic ops); ``payload`` packs the moments and the identity tail, sums them over
the process group, merges the reduced payload and reads its verdict; ``health`` keeps the deferred verdicts
behind ``distsync.check_sync``; ``checkpointing`` and ``fx`` keep recomputation and tracing right;
``compiled`` is the traceable forward used under ``torch.compile``; ``identity`` names each layer at its
first call and ``unwrapped`` warns of a model no data-parallel wrapper calls; ``subclass`` makes the twin
of a user's batch-norm subclass; ``ddp_buffers`` keeps DDP's broadcast off the running statistics. See
docs/architecture.md.
"""
