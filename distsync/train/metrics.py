"""Run outputs written by rank 0: ``metrics.jsonl``, ``summary.json`` and the ``curves.png`` plot.

Everything is strict JSON: a metric that is not finite (a diverged loss) is written as ``null``, never as
the bare ``NaN``/``Infinity`` that ``json.dumps`` emits by default and strict parsers reject.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["MetricsLog", "json_safe", "write_json_atomic", "plot_curves", "curves_figure"]


def json_safe(value):
    """``value`` with every non-finite float (at any depth of dicts, lists, tuples) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _dumps(value, **kwargs) -> str:
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


class MetricsLog:
    """Append-only JSON lines, one per logging interval or evaluation; a no-op on ranks other than 0.

    Rows carry ``kind`` (``train`` or ``eval``) and ``step``, and each ``(kind, step)`` appears once: after
    a resume, :meth:`truncate` drops the rows a killed attempt wrote past the checkpoint, and :meth:`write`
    skips a row whose ``(kind, step)`` is already in the file (the final evaluation of a finished run that
    is started again).
    """

    def __init__(self, path: str | os.PathLike, enabled: bool) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._written = {(r.get("kind"), r.get("step")) for r in self.rows()} if enabled else set()

    def write(self, **row) -> None:
        key = (row.get("kind"), row.get("step"))
        if self.enabled and key not in self._written:
            with open(self.path, "a") as f:
                f.write(_dumps(row) + "\n")
            self._written.add(key)

    def truncate(self, step: int) -> None:
        """Keep only the rows of steps ``<= step`` (all rows are dropped for a fresh start, ``step=0``)."""
        if not (self.enabled and self.path.exists()):
            return
        kept = [r for r in self.rows() if r.get("step", 0) <= step]
        write_text_atomic(self.path, "".join(_dumps(r) + "\n" for r in kept))
        self._written = {(r.get("kind"), r.get("step")) for r in kept}

    def rows(self) -> list[dict]:
        """The rows in the file; a line cut short by a crash mid-write is left out."""
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return [r for r in rows if isinstance(r, dict)]


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file, which is removed if writing fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Write ``data`` as strict JSON (non-finite floats as null), atomically."""
    write_text_atomic(path, _dumps(data, indent=2) + "\n")


_MARKERS_UP_TO = 30
"""Curves with at most this many points get a marker on each point."""


def finite_series(rows: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
    """The steps and ``scale``-d values of ``key`` in ``rows``, leaving out rows without a finite value."""
    points = [(r["step"], r.get(key)) for r in rows if isinstance(r.get(key), (int, float))]
    points = [(s, v * scale) for s, v in points if math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def plot_curves(rows: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Save :func:`curves_figure` of ``rows`` as a PNG at ``path``."""
    curves_figure(rows, title).savefig(path, dpi=100)


ACCURACY_SPAN = 10.0
"""The accuracy panel shows at least this many percentage points."""


def _labelled_floor(value: float, mantissas: tuple[int, ...]) -> float:
    """The largest of ``mantissas`` times a power of ten that is at most ``value`` (> 0)."""
    decade = 10 ** math.floor(math.log10(value))
    return max(m * decade for m in mantissas if m * decade <= value * (1 + 1e-12))


def _two_and_five(value: float, _position) -> str:
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""


def loss_axis(ax, shown: list[float]) -> None:
    """A logarithmic loss axis for the values ``shown``, labelled with plain numbers (0.5, not 5 x 10^-1).

    Under two decades, minor ticks at 2 and 5 times a power of ten are labelled too (all eight would
    crowd each other), and the axis goes down to a labelled tick at or below the lowest loss. A loss of
    zero or below (a memorized batch, a loss of your own) cannot sit on a log axis: the axis is then
    linear up to the smallest positive loss (matplotlib's ``symlog``) and says so, rather than drop it.
    """
    from matplotlib.ticker import FuncFormatter

    if not shown:
        ax.set_ylabel("loss")
        return
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    positive = [v for v in shown if v > 0]
    if len(positive) < len(shown):
        linear_below = _labelled_floor(min(positive), (1,)) if positive else 1.0
        ax.set_yscale("symlog", linthresh=linear_below)
        ax.yaxis.set_major_formatter(plain)
        ax.set_ylabel(f"loss (linear below {linear_below:g}, log above)")
        return
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plain)
    few_decades = math.log10(max(shown) / min(shown)) < 2
    ax.yaxis.set_minor_formatter(FuncFormatter(_two_and_five if few_decades else lambda *_: ""))
    ax.set_ylim(bottom=_labelled_floor(min(shown), (1, 2, 5) if few_decades else (1,)))
    ax.set_ylabel("loss (log scale)")


def curves_figure(rows: list[dict], title: str = ""):
    """Training and held-out loss (log axis) and held-out accuracy against the step, as a Figure.

    Non-finite values are left out; curves with few points show a marker on each. The figure is
    matplotlib's ``Figure`` itself, not one of ``pyplot``'s: making it changes neither the process's
    backend nor pyplot's list of open figures (an app that plots on its own keeps its window or notebook
    output), and nothing needs closing.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig = Figure(figsize=(10, 3.8))
    ax_loss, ax_acc = fig.subplots(1, 2, sharex=True)  # one step range

    def plot(ax, steps, values, **kwargs):
        marker = "o" if len(steps) <= _MARKERS_UP_TO else None
        ax.plot(steps, values, marker=marker, markersize=4, **kwargs)

    loss_steps, losses = finite_series(train, "loss")
    eval_steps, eval_losses = finite_series(evals, "eval_loss")
    plot(ax_loss, loss_steps, losses, label="train")
    plot(ax_loss, eval_steps, eval_losses, label="held-out")
    loss_axis(ax_loss, losses + eval_losses)
    ax_loss.set(xlabel="step", title="loss")
    ax_loss.legend()
    acc_steps, accuracies = finite_series(evals, "accuracy", scale=100.0)
    plot(ax_acc, acc_steps, accuracies, color="tab:green")
    ax_acc.set(xlabel="step", ylabel="%", title="held-out accuracy")
    # At least ACCURACY_SPAN points tall: a sample or two of difference must not look like a cliff.
    lowest = min(accuracies, default=0.0)
    ax_acc.set_ylim(max(0.0, min(lowest - 1.0, 100.0 - ACCURACY_SPAN)), 100.5)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3, which="both")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole steps, one at least
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
