"""Run directories: layout, manifest, lock, stop signals, metrics files (the imperative shell)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from phalanx.config import Config, resolve
from phalanx.envs import registry
from phalanx.errors import CheckpointError, ConfigError, PhalanxError, StorageError, storage_reason
from phalanx.version import __version__


@dataclass
class StopRequest:
    """The signal that asked a run to stop (None: none yet); see `stop_signals`."""

    signum: int | None = None


@contextlib.contextmanager
def stop_signals(announce: bool = True) -> Iterator[StopRequest]:
    """SIGTERM (how schedulers preempt) and a first SIGINT (Ctrl-C) are noted, not acted on at once, so the
    training loop can finish its update and write a checkpoint; a second SIGINT interrupts at once. `announce`: say
    so on stderr when the first Ctrl-C arrives (an update can take minutes, and silence invites the second Ctrl-C). The
    previous handlers come back on exit. Outside the main thread (where Python delivers signals) nothing
    is installed."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def note(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and stop.signum is not None:
            raise KeyboardInterrupt
        if announce and stop.signum is None and signum == signal.SIGINT:  # a scheduler's SIGTERM reads the last line
            # os.write, not print: a handler may interrupt a print to the same stream.
            os.write(2, b"\nCtrl-C: stopping after this update, then a checkpoint is written; "
                        b"press Ctrl-C again to stop at once (the update in flight is lost)\n")
        stop.signum = signum

    previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def writing(what: str, path: Path | str, after: str = "") -> Iterator[None]:
    """A failed read or write inside (OSError, or safetensors' wrapped I/O error) becomes a StorageError:
    one line naming `what`, `path` and why, then `after` (what was kept, what to do)."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        raise StorageError(f"could not write {what} '{path}': {storage_reason(e)}{after}") from None


def check_writable_dir(path: Path, what: str = "run directory") -> None:
    """Refuse, before anything is built, a directory a run could not write: one that is a file, or whose
    nearest existing ancestor cannot take a new file (read-only filesystem, no permission). Probed with an
    unnamed temporary file, so nothing is left behind and root on a read-only mount is refused too."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: mkdir would fail on it
            raise StorageError(f"{what} '{path}' cannot be made: '{probe}' is a broken symlink")
        probe = probe.parent
    if not probe.is_dir():
        if probe == path:
            raise StorageError(f"{what} '{path}' is a file, not a directory")
        raise StorageError(f"{what} '{path}' cannot be made: '{probe}' is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        where = "" if probe == path else f" (in '{probe}')"
        raise StorageError(f"{what} '{path}' is not writable{where}: {storage_reason(e)}") from None


def default_run_dir(env: str, stamp: float | None = None, tag: int | None = None) -> Path:
    """runs/<env>-<local time>-<6 hex digits>: the digits (`tag`, random unless given) keep runs launched in
    the same second apart (three seeds started together once found one name)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in env)
    tag = secrets.randbelow(1 << 24) if tag is None else tag
    return Path("runs") / f"{safe}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(stamp))}-{tag:06x}"


def git_revision() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def manifest(device: torch.device, seed: int) -> dict[str, Any]:
    info: dict[str, Any] = {
        "phalanx": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_revision": git_revision(),
        "device": str(device),
        "seed": seed,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


class RunLock:
    """An advisory lock so two trainings never write into the same run directory."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise PhalanxError(f"run directory '{self.path.parent}' is in use by another training") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def write_atomic(path: Path, write: Callable[[Path], None], what: str = "file") -> None:
    """`write` fills a temporary file beside `path`, which is synced and renamed over it: a reader sees the old file
    or the whole new one, and a failed write (a StorageError naming `what`) leaves the old file and no temporary
    one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(what, path):
        try:
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str, what: str = "file") -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text), what)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Parse metrics.jsonl, skipping a broken trailing line left by a kill."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(run_dir: Path, max_step: int) -> None:
    """Drop metric lines after `max_step` (written after the checkpoint we resume from)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    keep = [r for r in read_metrics(run_dir) if r.get("step", 0) <= max_step]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep), "metrics")


def write_metric_csvs(run_dir: Path) -> None:
    """`reward_breakdown.csv` (the env's reward terms) and `behavior_metrics.csv` (its other episode
    metrics and the league's win rates) per update, regenerated from metrics.jsonl, the one source
    of truth, so a resumed run never holds rows from the steps it replays."""
    rows = read_metrics(run_dir)
    reward_keys = sorted({k for r in rows for k in r if k.startswith("env_reward_")})
    behavior_keys = sorted({k for r in rows for k in r
                            if (k.startswith("env_") and not k.startswith(("env_reward_", "env_episode_")))
                            or k.startswith("league_win_rate_")})
    for name, keys in (("reward_breakdown.csv", reward_keys), ("behavior_metrics.csv", behavior_keys)):
        if not keys:
            continue
        derived = ["damage_ratio"] if {"env_damage_dealt", "env_damage_taken"} <= set(keys) else []
        lines = [",".join(["step", *(k.removeprefix("env_") for k in keys), *derived])]
        for r in rows:
            vals = [r.get(k) for k in keys]
            if derived:
                dealt, taken = r.get("env_damage_dealt"), r.get("env_damage_taken")
                vals.append(dealt / taken if dealt is not None and taken else None)
            lines.append(",".join([str(r["step"]), *("" if v is None else f"{v:.6g}" for v in vals)]))
        path = Path(run_dir) / name
        write_text_atomic(path, "\n".join(lines) + "\n")


RUN_ENTRIES = ("checkpoints", "league", "tb", "plots", "metrics.jsonl", "config.json", "manifest.json", "eval.json",
               "reward_breakdown.csv", "behavior_metrics.csv", ".lock")
# What a run leaves only when it ends on a fault, or with W&B on.
FAULT_ENTRIES = ("env_crash.txt", "nonfinite_update_*", "wandb", "wandb_id")


def run_entries(run_dir: Path) -> list[Path]:
    """The entries of an earlier run in `run_dir` (none of the user's own files, nor the lock a run holds)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [run_dir / n for n in RUN_ENTRIES if n != ".lock" and (run_dir / n).exists()]
    return found + sorted(p for pattern in FAULT_ENTRIES for p in run_dir.glob(pattern))


def check_fresh_run_dir(run_dir: Path, has_checkpoint: bool, overwrite: bool) -> None:
    """A new run never shares a directory with an earlier one: its metrics would follow the old rows, its
    events sit beside the old ones, its config replace theirs. Refused in one line unless `overwrite`."""
    if overwrite:
        return
    if has_checkpoint:
        raise ConfigError(f"run directory '{run_dir}' already holds a run; use --resume {run_dir} to continue it, "
                          f"another --run-dir, or --overwrite to start it afresh")
    old = run_entries(run_dir)
    if old:
        raise ConfigError(f"run directory '{run_dir}' holds an earlier run with no checkpoint "
                          f"({', '.join(p.name for p in old)}): it cannot be resumed; name a new --run-dir, or "
                          f"--overwrite to delete them and start afresh")


def clear_run_dir(run_dir: Path) -> None:
    """--overwrite: an earlier run's entries removed (the caller holds the run lock), the user's files kept."""
    for path in run_entries(run_dir):
        with writing("run directory", path):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory whose entries are symlinks: training writes, prunes and deletes in
    them, and must never do so outside the directory it was given."""
    for name in RUN_ENTRIES:
        p = Path(run_dir) / name
        if p.is_symlink():
            raise PhalanxError(f"'{p}' is a symlink (to '{os.readlink(p)}'); refusing to write outside the run "
                               f"directory '{run_dir}'")


def load_run_config(run_dir: Path) -> Config:
    """The resolved config a run directory was trained with."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"'{run_dir}' is not a run directory (no config.json)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"run file '{path}' is not valid JSON: {e}") from None
    if isinstance(data, dict):
        data.setdefault("mappo_values", "per_agent")  # runs from before the key trained per-agent critics
        data.setdefault("play_outcome_plies", 0)  # ... and played greedily at outcome_plies, not the env's default now
        data.setdefault("play_rollouts", 0)  # ... and greedily without a search
        data.setdefault("play_solve_empties", 0)  # ... and without solving their endgames
    manifest = Path(run_dir) / "manifest.json"
    if manifest.is_file():  # a plugin env trained from another directory: import it from where it was found
        try:
            source = json.loads(manifest.read_text()).get("env_source")
        except json.JSONDecodeError:
            source = None
        if isinstance(source, str):
            registry.add_plugin_root(source)
    return resolve(data)
