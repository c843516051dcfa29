"""metrics.jsonl and summary.json are strict JSON with every step once; curves.png reads well."""

from __future__ import annotations

import json
import math
import sys

import pytest
from launching import run_job

from distsync.train.metrics import MetricsLog, curves_figure, plot_curves, write_json_atomic


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_metrics_are_written_as_null(tmp_path, bad):
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    log.write(kind="train", step=5, loss=bad, lr=0.1)
    [row] = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row == {"kind": "train", "step": 5, "loss": None, "lr": 0.1}
    write_json_atomic(tmp_path / "summary.json", {"final_loss": bad, "nested": [1.0, bad], "steps": 5})
    summary = _strict((tmp_path / "summary.json").read_text())
    assert summary == {"final_loss": None, "nested": [1.0, None], "steps": 5}


def test_every_kind_and_step_is_written_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, enabled=True)
    for step in (5, 10, 15):
        log.write(kind="train", step=step, loss=1.0 / step)
    log.write(kind="eval", step=10, accuracy=0.5)
    # A resumed attempt: rows past the checkpoint (step 10) go, the rows up to it stay and are not repeated.
    resumed = MetricsLog(path, enabled=True)
    resumed.truncate(10)
    resumed.write(kind="eval", step=10, accuracy=0.5)
    resumed.write(kind="train", step=15, loss=0.07)
    rows = [_strict(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("train", 5),
        ("train", 10),
        ("eval", 10),
        ("train", 15),
    ]
    assert rows[-1]["loss"] == 0.07


def test_a_line_cut_short_by_a_crash_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 5, "loss": 1.0}\n{"kind": "train", "st')
    log = MetricsLog(path, enabled=True)
    log.truncate(5)
    assert log.rows() == [{"kind": "train", "step": 5, "loss": 1.0}]


def test_disabled_log_writes_nothing(tmp_path):
    MetricsLog(tmp_path / "metrics.jsonl", enabled=False).write(kind="train", step=1, loss=1.0)
    assert not (tmp_path / "metrics.jsonl").exists()


def _rows(n_train: int) -> list[dict]:
    rows = [{"kind": "train", "step": 5 * (i + 1), "loss": 2.0 * 0.8**i} for i in range(n_train)]
    rows += [{"kind": "eval", "step": 50, "accuracy": 0.9, "eval_loss": 0.3}]
    return rows + [{"kind": "train", "step": 5 * (n_train + 1), "loss": None}]  # a diverged interval


def test_loss_is_on_a_log_axis_with_markers_when_few_points(tmp_path):
    fig = curves_figure(_rows(8))
    ax_loss, ax_acc = fig.axes
    assert ax_loss.get_yscale() == "log"
    train_line = ax_loss.get_lines()[0]
    assert train_line.get_marker() == "o"
    assert len(train_line.get_xdata()) == 8  # the null loss is left out
    assert ax_acc.get_lines()[0].get_marker() == "o"
    many = curves_figure(_rows(200)).axes[0].get_lines()[0]
    assert many.get_marker() in (None, "None", "")
    # Under two decades: the minor ticks at 2 and 5 are labelled, the six others stay blank.
    fig.canvas.draw()
    minor = {t.get_text() for t in ax_loss.yaxis.get_minorticklabels() if t.get_text()}
    assert minor and all(label.lstrip("0.").startswith(("2", "5")) for label in minor), minor
    assert ax_acc.get_ylim()[1] <= 100.5  # a percentage
    assert all(float(tick).is_integer() for tick in ax_acc.get_xticks())  # steps
    plot_curves(_rows(8), tmp_path / "curves.png", title="t")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_panels_share_the_steps_label_the_lowest_loss_and_do_not_zoom_accuracy():
    rows = [{"kind": "train", "step": s, "loss": 0.9 * 0.7**s} for s in range(1, 21)]
    rows += [
        {"kind": "eval", "step": s, "accuracy": a, "eval_loss": 0.2} for s, a in ((10, 0.991), (20, 0.987))
    ]
    fig = curves_figure(rows)
    ax_loss, ax_acc = fig.axes
    assert ax_loss.get_xlim() == ax_acc.get_xlim()  # one step range for both panels
    lowest = min(r["loss"] for r in rows if r["kind"] == "train")
    assert min(_labelled_ticks(fig, ax_loss)) <= lowest  # labelled down to the lowest value plotted
    few = curves_figure(_rows(8))  # under two decades: a 2 or 5 tick may be the lowest label
    assert min(_labelled_ticks(few, few.axes[0])) <= 2.0 * 0.8**7
    bottom, top = ax_acc.get_ylim()
    assert top - bottom >= 10 and bottom <= 98.7 - 1  # 99.1% -> 98.7% is no cliff


def _labelled_ticks(fig, ax) -> list[float]:
    fig.canvas.draw()
    low, high = ax.get_ylim()
    ticks = ax.yaxis.get_majorticklabels() + ax.yaxis.get_minorticklabels()
    return [float(t.get_text()) for t in ticks if t.get_text() and low <= t.get_position()[1] <= high]


def test_zero_losses_stay_on_the_plot():
    losses = ((1, 0.7), (2, 0.02), (3, 0.0), (4, 0.0))
    rows = [{"kind": "train", "step": step, "loss": loss} for step, loss in losses]
    ax_loss = curves_figure(rows).axes[0]
    assert ax_loss.get_yscale() == "symlog"  # a log axis cannot show 0
    assert list(ax_loss.get_lines()[0].get_ydata()) == [0.7, 0.02, 0.0, 0.0]
    assert "linear below 0.01" in ax_loss.get_ylabel()


def _sweep_jobs(tmp_path) -> list:
    jobs = []
    for job, scale in (("0", 1.0), ("1", 1.5)):
        (tmp_path / job).mkdir()
        log = MetricsLog(tmp_path / job / "metrics.jsonl", enabled=True)
        for row in _rows(8):
            if row["kind"] == "train" and row["loss"] is not None:
                log.write(kind="train", step=row["step"], loss=row["loss"] * scale)
        jobs.append(tmp_path / job)
    return jobs


def test_the_sweep_plot_labels_its_log_axis_without_crowding(tmp_path):
    from distsync.train.sweep import _plot, _sweep_figure

    jobs = _sweep_jobs(tmp_path)
    fig = _sweep_figure(jobs, ["lr=0.1", "lr=0.2"])
    fig.draw_without_rendering()
    minor = [t.get_text() for t in fig.axes[0].yaxis.get_minorticklabels() if t.get_text()]
    assert minor and all(label.lstrip("0.").startswith(("2", "5")) for label in minor), minor
    _plot(tmp_path, jobs, ["lr=0.1", "lr=0.2"])
    assert (tmp_path / "sweep_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_plotting_leaves_the_apps_matplotlib_backend_and_pyplot_alone(tmp_path):
    """The curves are drawn in the user's processes (rank 0, the Hydra app that ran the sweep), which may
    plot on their own: neither switching their backend nor importing pyplot there."""
    code = (
        "import sys, pathlib, matplotlib\n"
        "from distsync.train.metrics import plot_curves\n"
        "from distsync.train.sweep import _plot\n"
        "import test_train_metrics as t\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "plot_curves(t._rows(8), out / 'curves.png')\n"
        "_plot(out, t._sweep_jobs(out), ['a', 'b'])\n"
        "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n"
    )
    proc = run_job([sys.executable, "-c", code, str(tmp_path)], tmp_path, MPLBACKEND="svg")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["svg", "False"]
    for png in ("curves.png", "sweep_curves.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("steps", [[6], [5, 10, 15]])
def test_the_step_axis_shows_whole_steps_even_for_one(steps):
    rows = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in steps]
    rows += [{"kind": "eval", "step": steps[-1], "eval_loss": 0.5, "accuracy": 0.5}]
    fig = curves_figure(rows)
    fig.draw_without_rendering()
    for ax in fig.axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if low <= t <= high]
        assert shown and all(t == int(t) for t in shown), shown
