"""The closing learning curve: drawn by a child forked before training, or here where forking is unsafe."""

import json
import subprocess
import sys
import threading

import pytest

from phalanx.errors import PhalanxError
from phalanx.plot import ClosingPlot, learning_curve_path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, updates=3):
    run_dir.mkdir(parents=True)
    rows = [{"step": 512 * (i + 1), "episode_return": float(i), "policy_loss": 0.1, "value_loss": 1.0, "entropy": 0.6,
             "approx_kl": 0.01, "explained_variance": 0.5} for i in range(updates)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# Run in a fresh interpreter: a test process has other threads, and there the plot is drawn in-process.
CHILD_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from phalanx.errors import PhalanxError
from phalanx.plot import ClosingPlot

def reaped(pid):
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False

out = {}
run, empty = Path(sys.argv[1]), Path(sys.argv[2])
with ClosingPlot() as plot:
    pid = plot.pid
    out["forked"] = pid is not None and pid != os.getpid()
    out["path"] = str(plot.draw(run))
    out["reaped"] = reaped(pid)
with ClosingPlot() as plot:
    pid = plot.pid
    try:
        plot.draw(empty)
    except PhalanxError as e:
        out["error"] = str(e)
with ClosingPlot() as plot:  # a run that failed: the child is let go without drawing
    pid = plot.pid
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        done = pid
    if done == pid:
        break
    time.sleep(0.05)
out["let_go"] = done == pid
print(json.dumps(out))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the closing plot forks on Linux only")
def test_forked_child_draws_the_run_answers_errors_and_exits(tmp_path):
    run, empty = tmp_path / "run", tmp_path / "empty"
    write_metrics(run)
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-c", CHILD_SCRIPT, str(run), str(empty)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["forked"], "a single-threaded process on Linux forks the plotting child"
    assert out["path"] == str(learning_curve_path(run.resolve()))
    assert learning_curve_path(run).read_bytes()[:8] == PNG_MAGIC
    assert out["reaped"], "waiting for the plot reaps the child"
    assert "has no metrics.jsonl rows to plot" in out["error"]  # the child's error, raised in the parent
    assert out["let_go"], "a plot that is never asked for ends its child"
    assert not (empty / "plots" / "learning_curve.png").exists()


def test_with_other_threads_the_plot_is_drawn_in_this_process(tmp_path):
    """Forking a process with other threads can deadlock the child: there the plot is drawn here, same file."""
    run = tmp_path / "run"
    write_metrics(run)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with ClosingPlot() as plot:
            assert plot.pid is None
            assert plot.draw(run) == learning_curve_path(run)
        assert learning_curve_path(run).read_bytes()[:8] == PNG_MAGIC
        with ClosingPlot() as plot, pytest.raises(PhalanxError, match="has no metrics.jsonl rows"):
            plot.draw(tmp_path)
    finally:
        stop.set()
        other.join()


def test_a_warmed_figure_draws_the_same_png_as_a_fresh_one(tmp_path):
    """The closing plot's child renders its figure once ahead (`LearningCurves.warm`): the file it then
    draws must be the one a fresh figure draws, byte for byte (placeholder lines gone, colours as fresh)."""
    from phalanx.plot import LearningCurves

    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        write_metrics(run, updates=5)
    for names in (runs[:1], runs):
        warmed = LearningCurves()
        warmed.warm()
        a = warmed.draw(names, tmp_path / "warmed.png").read_bytes()
        b = LearningCurves().draw(names, tmp_path / "fresh.png").read_bytes()
        assert a.startswith(PNG_MAGIC) and a == b
