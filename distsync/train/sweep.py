"""A sweep's summary across its jobs: ``sweep_summary.md`` (and ``.json``) and ``sweep_curves.png``.

Hydra runs :class:`SweepSummary` (a Hydra callback, registered in the job's config) as the jobs of a ``-m``
sweep end. It reads what each job left in its directory (``summary.json``, ``metrics.jsonl``,
``.hydra/overrides.yaml``), so it also summarizes jobs that failed (no ``summary.json``). Jobs that run at
once (``hydra.launcher.n_jobs``) summarize one at a time, so the last one to end writes the last word.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from hydra.types import RunMode

from distsync.train.metrics import MetricsLog, finite_series, loss_axis, write_json_atomic, write_text_atomic
from distsync.train.rundir import LOCK_NAME

__all__ = ["SweepSummary", "summarize_sweep"]

_METRICS = ("final_loss", "accuracy", "accuracy_top5", "eval_loss", "steps", "wall_seconds")


class SweepSummary(Callback):
    """Rewrite the sweep's summary in its directory as each job of a ``-m`` run ends, and at its end.

    After each job, not only at the end: Hydra skips ``on_multirun_end`` when a job failed, and the
    summary is worth most then.
    """

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            path = Path(config.hydra.sweep.dir) / "sweep_summary.md"
            new = not path.exists()
            summarize_sweep(config.hydra.sweep.dir)
            if new and path.exists():  # said once, when the first job ends: a sweep may end in a failure
                print(f"sweep summary (rewritten as each job ends): {path}", flush=True)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        if summarize_sweep(config.hydra.sweep.dir) is not None:
            print(f"sweep summary: {Path(config.hydra.sweep.dir) / 'sweep_summary.md'}", flush=True)


def summarize_sweep(sweep_dir: str | os.PathLike) -> list[dict] | None:
    """Summarize every job directory under ``sweep_dir``; return the rows (None if it holds no job)."""
    sweep = Path(sweep_dir)
    if not sweep.is_dir():
        return None
    with _one_at_a_time(sweep):
        jobs = sorted(
            (path.parent.parent for path in sweep.glob("**/.hydra/overrides.yaml")), key=_job_sort_key
        )
        return _summarize(sweep, jobs) if jobs else None


@contextlib.contextmanager
def _one_at_a_time(sweep: Path):
    """An exclusive ``flock`` on ``<sweep>/.summary.lock`` (none where the filesystem cannot lock)."""
    with open(sweep / ".summary.lock", "a") as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX)
        except OSError:
            pass
        yield  # the lock goes with the file


def _summarize(sweep: Path, jobs: list[Path]) -> list[dict]:
    rows = [_job_row(sweep, job) for job in jobs]
    common = set.intersection(*(set(row["overrides"]) for row in rows))
    swept = [[o for o in row["overrides"] if o not in common] for row in rows]
    write_json_atomic(sweep / "sweep_summary.json", {"jobs": rows})
    header = f"Overrides of every job: {' '.join(o for o in rows[0]['overrides'] if o in common) or '-'}\n\n"
    write_text_atomic(sweep / "sweep_summary.md", header + _table(rows, swept))
    _plot(sweep, jobs, [" ".join(labels) or row["job"] for labels, row in zip(swept, rows, strict=True)])
    return rows


def _job_sort_key(job: Path) -> tuple:
    return tuple(int(part) if part.isdigit() else math.inf for part in job.parts), str(job)


def _job_row(sweep: Path, job: Path) -> dict:
    overrides = [str(o) for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []]
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]  # a sweeper's own
    row: dict[str, Any] = {"job": str(job.relative_to(sweep)), "overrides": overrides}
    try:
        summary = json.loads((job / "summary.json").read_text())
    except (OSError, ValueError):
        return row | {"status": "running" if _running(job) else "failed"}
    pruned = summary.get("pruned_at_step")
    status = "done" if pruned is None else f"pruned at step {pruned}"
    return row | {"status": status} | {key: summary.get(key) for key in _METRICS}


def _running(job: Path) -> bool:
    """Whether a job still holds its run directory's lock (a job running beside this one)."""
    try:
        fd = os.open(job / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _table(rows: list[dict], swept: list[list[str]]) -> str:
    lines = [
        "| job | overrides | status | " + " | ".join(_METRICS) + " |",
        "|---|---|---|" + "---:|" * len(_METRICS),
    ]
    for row, overrides in zip(rows, swept, strict=True):
        values = [_cell(row.get(key)) for key in _METRICS]
        lines.append(
            f"| {row['job']} | {' '.join(overrides) or '-'} | {row['status']} | " + " | ".join(values) + " |"
        )
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _plot(sweep: Path, jobs: list[Path], labels: list[str]) -> None:
    """Save :func:`_sweep_figure` as ``sweep_curves.png`` in ``sweep``."""
    _sweep_figure(jobs, labels).savefig(sweep / "sweep_curves.png", dpi=100)


def _sweep_figure(jobs: list[Path], labels: list[str]):
    """Each job's training loss and held-out accuracy, one line per job, labelled by its own overrides: a
    ``Figure`` of its own, as :func:`~distsync.train.metrics.curves_figure` makes (the sweep's process is
    the user's app: its matplotlib backend and pyplot figures stay as they are)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    ax_loss, ax_acc = fig.subplots(1, 2, sharex=True)
    for job, label in zip(jobs, labels, strict=True):
        rows = MetricsLog(job / "metrics.jsonl", enabled=False).rows()
        train = finite_series([r for r in rows if r.get("kind") == "train"], "loss")
        evals = finite_series([r for r in rows if r.get("kind") == "eval"], "accuracy", scale=100.0)
        if train[0]:
            ax_loss.plot(*train, label=label)
        if evals[0]:
            ax_acc.plot(*evals, marker="o", markersize=3, label=label)
    loss_axis(ax_loss, [v for line in ax_loss.get_lines() for v in line.get_ydata()])
    ax_loss.set(xlabel="step", title="training loss")
    ax_acc.set(xlabel="step", ylabel="%", title="held-out accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3, which="both")
    if any(ax_loss.get_lines()):
        ax_loss.legend(fontsize="small")
    fig.tight_layout()
    return fig
