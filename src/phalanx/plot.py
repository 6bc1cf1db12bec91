"""Learning-curve PNGs from a run's metrics.jsonl."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import NoReturn

from phalanx.errors import PhalanxError
from phalanx.runs import read_metrics, writing


def learning_curve_path(run_dir: Path) -> Path:
    """Where a run's learning curve is drawn by default."""
    return Path(run_dir) / "plots" / "learning_curve.png"


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Plot episode return and the losses against steps; returns the PNG path."""
    return plot_runs([Path(run_dir)], out or learning_curve_path(run_dir))


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """The same panels with one line per run (labelled by its directory's name); returns `out`."""
    return LearningCurves().draw(run_dirs, out)


PANELS = (("episode_return", "episode return"), ("policy_loss", "policy loss"), ("value_loss", "value loss"),
          ("entropy", "entropy"), ("approx_kl", "approx KL"), ("explained_variance", "explained variance"))


class LearningCurves:
    """The figure of `plot_runs`: its panels made on creation and drawn once per `draw`. `warm` renders it
    empty, so that a later `draw` reuses the ticks and glyphs it made (matplotlib's ticks were most of the
    drawing: the closing plot's child warms it while the run trains, #27)."""

    def __init__(self) -> None:
        # The object API, not pyplot: pyplot's import and figure manager cost half a second of every run's
        # closing plot.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=(13, 7))
        FigureCanvasAgg(self.fig)
        self.axes = list(self.fig.subplots(2, 3).flat)
        for ax, (_, title) in zip(self.axes, PANELS):
            ax.set_title(title)
            ax.set_xlabel("steps")
            ax.grid(alpha=0.3)
            # Few ticks: each is a handful of artists, and making them was most of the drawing (0.8 s -> 0.35 s).
            ax.locator_params(nbins=4)
        # Fixed margins: tight_layout measured every label's text extent (a third of the drawing time).
        self.fig.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.9, wspace=0.25, hspace=0.35)

    def warm(self) -> None:
        """Render once with placeholder lines (nothing written), making the ticks and text a draw needs."""
        for ax in self.axes:
            ax.plot([0, 1e6], [-1e3, 1e3])
        self.fig.canvas.draw()
        for ax in self.axes:
            for line in list(ax.lines):
                line.remove()
            ax.set_prop_cycle(None)  # the runs' lines take the first colours, as in a figure never warmed

    def draw(self, run_dirs: list[Path], out: Path) -> Path:
        out = Path(out)
        formats = self.fig.canvas.get_supported_filetypes()
        kind = out.suffix.lstrip(".").lower() or "png"
        if kind not in formats:
            raise PhalanxError(f"plot file '{out}' has format '{kind}'; the formats are {', '.join(sorted(formats))}")
        runs = [(Path(d), read_metrics(Path(d))) for d in run_dirs]
        for run_dir, rows in runs:
            if not rows:
                raise PhalanxError(f"'{run_dir}' has no metrics.jsonl rows to plot")
        for ax, (key, _) in zip(self.axes, PANELS):
            for run_dir, rows in runs:
                pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), lw=1.5, label=run_dir.name)
            ax.relim()
            ax.autoscale_view()
        if len(runs) > 1:
            self.axes[0].legend(fontsize=8)
        self.fig.suptitle(str(runs[0][0]) if len(runs) == 1 else f"{len(runs)} runs")
        # Written whole, then renamed: a reader never sees half a PNG (the closing plot may be drawn while the
        # user already looks for it, see `ClosingPlot`).
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        with writing("plot", out):
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                self.fig.savefig(tmp, dpi=90, format=kind)
                os.replace(tmp, out)
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
        return out


class ClosingPlot:
    """The learning curve `phalanx train` draws when it ends, by a child forked before training where the
    platform forks safely (Linux, one Python thread): the child imports matplotlib while the run trains, so
    the plot costs the end of a run its drawing only (importing matplotlib was most of a second, #27).
    Elsewhere the plot is drawn in this process when asked. Use it as a context manager: leaving it
    without `draw` (a failed run) lets the child go."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._ask: int | None = None  # run directory, parent -> child
        self._answer: int | None = None  # "ok" when drawn, else the error; child -> parent
        if not _forks_safely():
            return
        ask_r, ask_w = os.pipe()
        answer_r, answer_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _plot_child(ask_r, answer_w, close=(ask_w, answer_r))
        os.close(ask_r)
        os.close(answer_w)
        self.pid, self._ask, self._answer = pid, ask_w, answer_r

    def __enter__(self) -> ClosingPlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def draw(self, run_dir: Path, wait: bool = True) -> Path:
        """Draw the run's learning curve -> its path. `wait=False` returns at once where a child draws (the
        plot appears a moment later); otherwise, and without a child, the file is there on return."""
        run_dir = Path(run_dir)
        if self.pid is None:
            return plot_run(run_dir)
        assert self._ask is not None and self._answer is not None
        try:
            os.write(self._ask, os.fsencode(str(run_dir.resolve())) + b"\n")
        except BrokenPipeError:  # the child is gone (killed, or it could not start): draw here
            self.close()
            return plot_run(run_dir)
        os.close(self._ask)
        self._ask = None
        if not wait:
            return learning_curve_path(run_dir)
        with os.fdopen(self._answer, "rb") as answer:
            self._answer = None
            reply = answer.read()
        os.waitpid(self.pid, 0)
        self.pid = None
        if reply == b"":  # the child died before it answered
            return plot_run(run_dir)
        if reply != b"ok":
            raise PhalanxError(reply.decode(errors="replace"))
        return learning_curve_path(run_dir)

    def close(self) -> None:
        """Let the child go (it exits when its request pipe closes); reap it if it already has."""
        for fd in (self._ask, self._answer):
            if fd is not None:
                os.close(fd)
        self._ask = self._answer = None
        if self.pid is not None:
            try:
                os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pass
            self.pid = None


def _forks_safely() -> bool:
    """Linux, and no other Python thread: a thread holding a lock at the fork would leave it held forever
    in the child."""
    return sys.platform == "linux" and threading.active_count() == 1


def _plot_child(ask: int, answer: int, close: tuple[int, ...]) -> NoReturn:
    """A forked child: import, wait for a run directory on `ask`, draw it, answer on `answer`, exit (never
    returning into the parent's code, never running its cleanup). `close`: the parent's ends of the pipes."""
    code = 1
    try:
        for fd in close:
            os.close(fd)
        # Its own session, stdio on /dev/null: the terminal's Ctrl-C is the parent's to handle, a closed
        # terminal does not stop the drawing, and a pipe reading the parent's output ends with the parent.
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        # The wait's purpose: matplotlib imported and the figure made and rendered once, ahead.
        curves: LearningCurves | None = None
        try:
            curves = LearningCurves()
            curves.warm()
        except Exception:  # reported when a plot is asked for, by a fresh figure
            curves = None
        with os.fdopen(ask, "rb") as requests:
            request = requests.readline().strip()
        if request:
            try:
                run_dir = Path(os.fsdecode(request))
                (curves or LearningCurves()).draw([run_dir], learning_curve_path(run_dir))
                reply = b"ok"
            except Exception as e:
                reply = str(e).encode() or type(e).__name__.encode()
            try:
                os.write(answer, reply)
            except BrokenPipeError:  # nobody waits for it (drawn in the background)
                pass
        code = 0
    finally:
        os._exit(code)
