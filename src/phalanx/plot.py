"""Learning-curve PNGs from a run's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.runs import read_metrics


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Plot episode return and the losses against steps; returns the PNG path."""
    run_dir = Path(run_dir)
    return plot_runs([run_dir], out or run_dir / "plots" / "learning_curve.png")


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
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(str(runs[0][0]) if len(runs) == 1 else f"{len(runs)} runs")
    # Fixed margins: tight_layout measured every label's text extent (a third of the drawing time).
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.9, wspace=0.25, hspace=0.35)
    fig.savefig(out, dpi=90)
    return out
