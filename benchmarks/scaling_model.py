"""Communication cost per BN layer per training step, on paper: distsync vs. torch.nn.SyncBatchNorm.

    python benchmarks/scaling_model.py      # prints the Markdown tables used in docs/performance.md

Alpha-beta model: a message of ``n`` bytes costs ``alpha + n * beta``. Per layer and step, distsync does 2
all-reduces of ``payload_size(C) * 8`` bytes (float64 moments + 15 tail fields, ``2C + 15`` rounded up to a
power of two, at least 256), forward and backward. nn.SyncBatchNorm all-gathers ``(2C + 1)`` float32 per rank
forward (mean, invstd, count), so ``W * (2C + 1) * 4`` bytes land on every rank, and all-reduces ``2C``
float32 backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distsync._syncbn.payload import payload_size


@dataclass(frozen=True)
class Link:
    """Latency per message step (seconds) and seconds per byte of one link direction."""

    name: str
    alpha: float
    beta: float


INFINIBAND = Link("InfiniBand HDR 200 Gb/s per GPU: alpha = 5 us, 1/beta = 25 GB/s", 5e-6, 1 / 25e9)
NVLINK = Link("NVLink 4 (H100 node): alpha = 2 us, 1/beta = 200 GB/s", 2e-6, 1 / 200e9)


def all_reduce_ring(n: float, w: int, link: Link) -> float:
    """Ring: reduce-scatter + all-gather, 2(W-1) steps of n/W bytes."""
    return 2 * (w - 1) * link.alpha + 2 * (w - 1) / w * n * link.beta


def all_reduce_tree(n: float, w: int, link: Link) -> float:
    """Recursive halving + doubling (Rabenseifner): 2 log2 W steps, same bytes as the ring."""
    return 2 * math.log2(w) * link.alpha + 2 * (w - 1) / w * n * link.beta


def all_gather_ring(m: float, w: int, link: Link) -> float:
    """Ring all-gather of m bytes per rank: W-1 steps of m bytes."""
    return (w - 1) * link.alpha + (w - 1) * m * link.beta


def all_gather_tree(m: float, w: int, link: Link) -> float:
    """Recursive doubling all-gather: log2 W steps, (W-1) m bytes received in all."""
    return math.log2(w) * link.alpha + (w - 1) * m * link.beta


def distsync_cost(c: int, w: int, link: Link, tree: bool) -> float:
    all_reduce = all_reduce_tree if tree else all_reduce_ring
    return 2 * all_reduce(payload_size(c) * 8, w, link)


def torch_syncbn_cost(c: int, w: int, link: Link, tree: bool) -> float:
    if tree:
        return all_gather_tree((2 * c + 1) * 4, w, link) + all_reduce_tree(2 * c * 4, w, link)
    return all_gather_ring((2 * c + 1) * 4, w, link) + all_reduce_ring(2 * c * 4, w, link)


def markdown(link: Link, worlds: list[int], channels: list[int]) -> str:
    lines = [
        f"{link.name}; microseconds per BN layer per step (forward + backward communication)",
        "",
        "| W | C | distsync ring | distsync tree | nn.SyncBatchNorm ring | nn.SyncBatchNorm tree "
        "| SyncBN bytes/rank fwd | SyncBN / distsync (tree) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in worlds:
        for c in channels:
            d_ring, d_tree = (distsync_cost(c, w, link, tree) * 1e6 for tree in (False, True))
            s_ring, s_tree = (torch_syncbn_cost(c, w, link, tree) * 1e6 for tree in (False, True))
            gathered = w * (2 * c + 1) * 4
            lines.append(
                f"| {w} | {c} | {d_ring:,.1f} | {d_tree:,.1f} | {s_ring:,.1f} | {s_tree:,.1f} "
                f"| {gathered / 1024:,.1f} KiB | {s_tree / d_tree:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(INFINIBAND, [2**k for k in range(1, 11)], [64, 512, 2048]))
    print()
    print(markdown(NVLINK, [2, 4, 8], [64, 512, 2048]))
