"""Run outputs written by rank 0: ``metrics.jsonl``, ``summary.json`` and the ``curves.png`` plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["MetricsLog", "write_json_atomic", "plot_curves"]


class MetricsLog:
    """Append-only JSON lines, one per logging interval or evaluation; a no-op on ranks other than 0.

    Rows carry ``kind`` (``train`` or ``eval``) and ``step``. After a resume, :meth:`truncate` drops the
    rows a killed attempt wrote past the checkpoint, so every step appears once.
    """

    def __init__(self, path: str | os.PathLike, enabled: bool) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def write(self, **row) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(_strict_json(row) + "\n")

    def truncate(self, step: int) -> None:
        """Keep only the rows of steps ``<= step``."""
        if self.enabled and self.path.exists():
            rows = [line for line in self.path.read_text().splitlines() if line.strip()]
            kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    write_text_atomic(path, _strict_json(data, indent=2) + "\n")


def _strict_json(data: dict, indent: int | None = None) -> str:
    """JSON that strict parsers read: a metric that is not finite (a diverged loss) is written as null."""
    return json.dumps(_finite_or_none(data), indent=indent, allow_nan=False)


def _finite_or_none(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(v) for v in value]
    return value


def plot_curves(rows: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Training loss and held-out accuracy against the step, side by side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    few = len(train) <= 20  # with few points, markers show where each one is
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], "o-" if few else "-", label="train")
    ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out")
    ax_loss.set(xlabel="step", ylabel="cross-entropy", title="loss", yscale="log")
    ax_loss.legend()
    ax_acc.plot([r["step"] for r in evals], [100 * r["accuracy"] for r in evals], "o-")
    ax_acc.set(xlabel="step", ylabel="%", title="held-out accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
