"""Learning-curve PNGs from a run's metrics.jsonl."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.runs import read_metrics


def learning_curve_path(run_dir: Path) -> Path:
    """Where a run's learning curve is drawn by default."""
    return Path(run_dir) / "plots" / "learning_curve.png"


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Plot episode return and the losses against steps; returns the PNG path."""
    return plot_runs([Path(run_dir)], out or learning_curve_path(run_dir))


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """The same panels with one line per run (labelled by its directory's name); returns `out`."""
    # The object API, not pyplot: pyplot's import and figure manager cost half a second of every run's
    # closing plot.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [(Path(d), read_metrics(Path(d))) for d in run_dirs]
    for run_dir, rows in runs:
        if not rows:
            raise PhalanxError(f"'{run_dir}' has no metrics.jsonl rows to plot")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    panels = [("episode_return", "episode return"), ("policy_loss", "policy loss"), ("value_loss", "value loss"),
              ("entropy", "entropy"), ("approx_kl", "approx KL"), ("explained_variance", "explained variance")]
    fig = Figure(figsize=(13, 7))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    for ax, (key, title) in zip(axes.flat, panels):
        for run_dir, rows in runs:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), lw=1.5, label=run_dir.name)
        ax.set_title(title)
        ax.set_xlabel("steps")
        ax.grid(alpha=0.3)
        # Few ticks: each is a handful of artists, and making them was most of the drawing (0.8 s -> 0.35 s).
        ax.locator_params(nbins=4)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(str(runs[0][0]) if len(runs) == 1 else f"{len(runs)} runs")
    # Fixed margins: tight_layout measured every label's text extent (a third of the drawing time).
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.9, wspace=0.25, hspace=0.35)
    # Written whole, then renamed: a reader never sees half a PNG (the closing plot may be drawn while the
    # user already looks for it, see `plot_run_in_background`).
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, dpi=90, format=out.suffix.lstrip(".") or "png")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def plot_run_in_background(run_dir: Path) -> Path:
    """`plot_run` in a forked child where the platform forks safely (Linux), so `phalanx train` in a terminal
    gives the prompt back at once: importing matplotlib and drawing cost a second of a short run (#27).
    -> where the plot appears. The child draws nothing with torch and exits without the parent's cleanup."""
    run_dir = Path(run_dir)
    if sys.platform != "linux":
        return plot_run(run_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return learning_curve_path(run_dir)
    code = 1
    try:
        # Off the terminal: the shell's next prompt must not receive a late message, nor wait for this child,
        # and a terminal that closes (SIGHUP to its sessions) does not stop the drawing.
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        plot_run(run_dir)
        code = 0
    finally:
        os._exit(code)
