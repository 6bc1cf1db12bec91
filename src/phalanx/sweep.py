"""`phalanx sweep`: configurations x seeds, each an ordinary run directory, trained in parallel local
processes (or as tasks on a Ray cluster), resumable.

A sweep is a spec (YAML, TOML or JSON):

    base: {env: cartpole, total_steps: 50000}      # config keys every trial shares
    grid: {lr: [1e-3, 3e-3], num_epochs: [4, 8]}   # every combination; or
    random: {lr: {log_uniform: [1e-4, 1e-2]}}      # `trials` draws (a list draws among its values); or
    optuna: {lr: {log_uniform: [1e-4, 1e-2]}}      # Optuna's TPE sampler (`optuna` extra), `trials` of them
    trials: 8
    seeds: [1, 2, 3]
    metric: eval_mean_return                       # what Optuna maximises (eval.json's mean_return)

Its directory holds `sweep.json` (the spec and every trial: swept values, seed, status, result),
`runs/<trial>/` (run directories), `logs/<trial>.log` and, for Optuna, `optuna.journal` (the study).
Starting the same sweep again keeps the finished runs, resumes the unfinished ones from their last
checkpoint and starts the rest.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from phalanx import checkpoint as ckpt
from phalanx import runs
from phalanx.config import FIELDS, FileLayer, load_file, resolve
from phalanx.errors import ConfigError

SWEEP_FILE = "sweep.json"
SPEC_KEYS = ("base", "grid", "random", "optuna", "trials", "seeds", "metric", "sampler_seed")
DISTRIBUTIONS = ("uniform", "log_uniform", "int")


@dataclass
class Trial:
    """One run of the sweep: a configuration (its number and swept values) with one seed."""

    name: str
    config: int
    seed: int
    values: dict[str, Any]
    status: str = "pending"  # pending | done | failed
    result: float | None = None
    optuna_number: int | None = None
    note: str = ""


@dataclass
class Sweep:
    directory: Path
    spec: dict[str, Any]
    trials: list[Trial] = field(default_factory=list)

    @property
    def file(self) -> Path:
        return self.directory / SWEEP_FILE

    def run_dir(self, t: Trial) -> Path:
        return self.directory / "runs" / t.name

    def save(self) -> None:
        ckpt.write_json_atomic(self.file, {"spec": self.spec, "trials": [asdict(t) for t in self.trials]})


# -- the spec ------------------------------------------------------------------------------------
def read_spec(path: str | Path) -> dict[str, Any]:
    """A sweep spec from a file, checked: known sections, known config keys, well-formed values."""
    spec = load_file(path)
    return check_spec(spec)


def check_spec(spec: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ConfigError(f"sweep spec key '{unknown[0]}' is unknown; allowed: {', '.join(SPEC_KEYS)}")
    kinds = [k for k in ("grid", "random", "optuna") if spec.get(k)]
    if len(kinds) > 1:
        raise ConfigError(f"sweep spec has {' and '.join(kinds)}; give one of grid, random or optuna")
    seeds = spec.get("seeds", [1])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"sweep spec key 'seeds' must be a non-empty list of integers; got {seeds!r}")
    for section in ("base", *kinds):
        for key in spec.get(section) or {}:
            if key not in FIELDS or key in ("seed", "run_dir"):
                raise ConfigError(f"sweep spec {section}.{key}: not a config key a sweep may set (see `phalanx train --help`)")
    for kind in ("random", "optuna"):
        for key, dist in (spec.get(kind) or {}).items():
            _check_distribution(f"{kind}.{key}", dist)
    for key, values in (spec.get("grid") or {}).items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep spec grid.{key} must be a non-empty list of values; got {values!r}")
    if kinds and kinds[0] in ("random", "optuna"):
        trials = spec.get("trials")
        if not isinstance(trials, int) or trials < 1:
            raise ConfigError(f"sweep spec key 'trials' must be a positive integer for {kinds[0]}; got {trials!r}")
    return spec


def _check_distribution(where: str, dist: Any) -> None:
    if isinstance(dist, list) and dist:
        return
    if isinstance(dist, dict) and len(dist) == 1:
        (kind, bounds), = dist.items()
        if kind in DISTRIBUTIONS and isinstance(bounds, list) and len(bounds) == 2 and bounds[0] < bounds[1] \
                and (kind != "log_uniform" or bounds[0] > 0):
            return
    raise ConfigError(f"sweep spec {where} must be a list of values or one of {{uniform|log_uniform|int: [low, high]}} "
                      f"with low < high (log_uniform: low > 0); got {dist!r}")


def grid_values(spec: dict[str, Any]) -> list[dict[str, Any]]:
    grid = spec.get("grid") or {}
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))] or [{}]


def random_values(spec: dict[str, Any]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(spec.get("sampler_seed", 0))
    out = []
    for _ in range(spec["trials"]):
        values = {}
        for key, dist in spec["random"].items():
            if isinstance(dist, list):
                values[key] = dist[int(rng.integers(len(dist)))]
                continue
            (kind, (lo, hi)), = dist.items()
            if kind == "uniform":
                values[key] = float(rng.uniform(lo, hi))
            elif kind == "log_uniform":
                values[key] = float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            else:
                values[key] = int(rng.integers(lo, hi + 1))
        out.append(values)
    return out


def suggest(trial: Any, space: dict[str, Any]) -> dict[str, Any]:
    """Values for one Optuna trial from the spec's distributions."""
    values = {}
    for key, dist in space.items():
        if isinstance(dist, list):
            values[key] = trial.suggest_categorical(key, dist)
            continue
        (kind, (lo, hi)), = dist.items()
        if kind == "int":
            values[key] = trial.suggest_int(key, int(lo), int(hi))
        else:
            values[key] = trial.suggest_float(key, float(lo), float(hi), log=kind == "log_uniform")
    return values


def make_trials(spec: dict[str, Any], configs: list[dict[str, Any]], first: int = 0) -> list[Trial]:
    seeds = spec.get("seeds", [1])
    return [Trial(f"c{first + i:03d}-s{s}", first + i, s, values) for i, values in enumerate(configs) for s in seeds]


def trial_config(spec: dict[str, Any], t: Trial, workers: int) -> dict[str, Any]:
    """The config keys of a trial's run: base, its swept values, its seed; quiet, and threads shared out."""
    layer = {**(spec.get("base") or {}), **t.values, "seed": t.seed, "progress": False}
    layer.setdefault("torch_threads", max(1, (os.cpu_count() or 1) // workers))
    return layer


# -- one trial ------------------------------------------------------------------------------------
def trial_command(sweep: Sweep, t: Trial, workers: int) -> list[str]:
    run = sweep.run_dir(t)
    if ckpt.list_checkpoints(run):
        return [sys.executable, "-m", "phalanx", "train", "--resume", str(run)]
    cfg_file = trial_config_file(sweep, t)
    cfg_file.parent.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(yaml.safe_dump(trial_config(sweep.spec, t, workers), sort_keys=True))
    # A trial that failed before its first checkpoint starts again afresh in its own directory.
    return [sys.executable, "-m", "phalanx", "train", "--config", str(cfg_file), "--run-dir", str(run), "--overwrite"]


def trial_config_file(sweep: Sweep, t: Trial) -> Path:
    return sweep.directory / "configs" / f"{t.name}.yaml"


def run_result(run: Path, metric: str) -> float | None:
    """A finished run's score: eval.json's `metric` without its `eval_` prefix (default mean_return),
    else the last metrics.jsonl row's `metric`."""
    ev = run / "eval.json"
    if metric.startswith("eval_") and ev.is_file():
        value = json.loads(ev.read_text()).get(metric[len("eval_"):])
        return float(value) if isinstance(value, (int, float)) else None
    rows = runs.read_metrics(run)
    value = rows[-1].get(metric) if rows else None
    return float(value) if isinstance(value, (int, float)) else None


def _run_command(cmd: list[str], log: str, cwd: str) -> int:
    """Run one trial's training process, its output in `log` (also what a Ray task runs)."""
    with open(log, "ab") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd).returncode


# -- backends -------------------------------------------------------------------------------------
Finish = Callable[[Trial, int], None]


def run_local(sweep: Sweep, todo: list[Trial], workers: int, finish: Finish) -> None:
    """Up to `workers` training processes at a time; stopping the sweep (Ctrl-C, SIGTERM) stops them."""
    pending = list(todo)
    active: dict[subprocess.Popen, tuple[Trial, Any]] = {}
    try:
        while pending or active:
            while pending and len(active) < workers:
                t = pending.pop(0)
                log = open(_log_path(sweep, t), "ab")  # noqa: SIM115 - closed when the process ends
                proc = subprocess.Popen(trial_command(sweep, t, workers), stdout=log, stderr=subprocess.STDOUT,
                                        cwd=os.getcwd())
                active[proc] = (t, log)
            time.sleep(0.2)
            for proc in [p for p in active if p.poll() is not None]:
                t, log = active.pop(proc)
                log.close()
                finish(t, proc.returncode)
    finally:  # a stopped sweep stops its runs; their checkpoints let the next start resume them
        for proc in active:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, (_, log) in active.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def run_ray(sweep: Sweep, todo: list[Trial], workers: int, finish: Finish, address: str) -> None:
    """Each trial a Ray task on the cluster at `address` (the sweep directory must be on a filesystem
    every node sees, and each node must have Phalanx installed)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend ray needs Ray: pip install 'phalanx[ray]'") from None
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(_run_command)
        futures = {task.remote(trial_command(sweep, t, workers), str(_log_path(sweep, t)), os.getcwd()): t for t in todo}
        while futures:
            ready, _ = ray.wait(list(futures), num_returns=1)
            for f in ready:
                finish(futures.pop(f), ray.get(f))
    finally:
        ray.shutdown()


def _log_path(sweep: Sweep, t: Trial) -> Path:
    path = sweep.directory / "logs" / f"{t.name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# -- the sweep ------------------------------------------------------------------------------------
def open_sweep(directory: Path, spec: dict[str, Any] | None) -> Sweep:
    """The sweep in `directory`: its saved state, or a new one from `spec`. A saved sweep must have the same spec."""
    directory = Path(directory)
    file = directory / SWEEP_FILE
    if file.is_file():
        saved = json.loads(file.read_text())
        if spec is not None and json.dumps(saved["spec"], sort_keys=True) != json.dumps(spec, sort_keys=True):
            raise ConfigError(f"'{directory}' holds another sweep (its spec differs); use another --dir or the same spec")
        return Sweep(directory, saved["spec"], [Trial(**t) for t in saved["trials"]])
    if spec is None:
        raise ConfigError(f"'{directory}' holds no sweep ({SWEEP_FILE} missing); give a spec file")
    sweep = Sweep(directory, spec)
    if not spec.get("optuna"):
        sweep.trials = make_trials(spec, random_values(spec) if spec.get("random") else grid_values(spec))
    for t in sweep.trials:  # every trial's config must resolve before anything runs, as the file its run reads
        resolve(FileLayer(trial_config(spec, t, 1), trial_config_file(sweep, t)))
    directory.mkdir(parents=True, exist_ok=True)
    sweep.save()
    return sweep


def run_sweep(sweep: Sweep, workers: int = 2, backend: str = "local", address: str | None = None,
              echo: Callable[[str], None] = print) -> Sweep:
    """Train every unfinished trial; returns the sweep with results. A run that fails is marked failed (its
    log names why) and retried when the sweep starts again."""
    if backend not in ("local", "ray"):
        raise ConfigError(f"--backend must be local or ray; got {backend!r}")
    lock = runs.RunLock(sweep.directory)
    try:
        lock.acquire()
    except Exception:
        raise ConfigError(f"sweep directory '{sweep.directory}' is in use by another sweep") from None
    metric = sweep.spec.get("metric", "eval_mean_return")

    def finish(t: Trial, rc: int) -> None:
        t.status = "done" if rc == 0 else "failed"
        t.result = run_result(sweep.run_dir(t), metric) if rc == 0 else None
        t.note = "" if rc == 0 else f"exit status {rc}; see logs/{t.name}.log"
        sweep.save()
        shown = f"{t.result:.3f}" if t.result is not None else "-"
        echo(f"{t.name} {t.status} {metric}={shown} {json.dumps(t.values)}")

    def execute(todo: list[Trial]) -> None:
        if not todo:
            return
        if backend == "ray":
            run_ray(sweep, todo, workers, finish, address or "auto")
        else:
            run_local(sweep, todo, workers, finish)

    try:
        kept = sum(t.status == "done" for t in sweep.trials)
        if kept:
            echo(f"sweep {sweep.directory}: {kept} finished runs kept")
        execute([t for t in sweep.trials if t.status != "done"])
        if sweep.spec.get("optuna"):
            _optuna_rounds(sweep, workers, execute)
    finally:
        lock.release()
    return sweep


def _optuna_rounds(sweep: Sweep, workers: int, execute: Callable[[list[Trial]], None]) -> None:
    """Ask Optuna for configurations `workers` at a time, train each over the seeds, tell it their mean."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("sweep spec 'optuna' needs Optuna: pip install 'phalanx[sweep]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(sweep.directory / "optuna.journal")))
    study = optuna.create_study(study_name="phalanx", storage=storage, load_if_exists=True, direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=sweep.spec.get("sampler_seed", 0)))
    space, n_seeds = sweep.spec["optuna"], len(sweep.spec.get("seeds", [1]))

    def tell_finished() -> None:
        told = {t.number for t in study.trials if t.state != optuna.trial.TrialState.RUNNING}
        for number, group in itertools.groupby(sorted((t for t in sweep.trials if t.optuna_number is not None),
                                                      key=lambda t: t.optuna_number), key=lambda t: t.optuna_number):
            group = list(group)
            if number in told or not all(t.status == "done" for t in group):
                continue
            scores = [t.result for t in group if t.result is not None]
            if scores:
                study.tell(number, float(np.mean(scores)))
            else:
                study.tell(number, state=optuna.trial.TrialState.FAIL)

    tell_finished()
    while True:
        configs = max((t.config for t in sweep.trials), default=-1) + 1
        left = sweep.spec["trials"] - configs
        if left <= 0:
            break
        batch = []
        for _ in range(min(left, max(1, workers // n_seeds))):
            ot = study.ask()
            new = make_trials(sweep.spec, [suggest(ot, space)], first=configs + len(batch) // n_seeds)
            for t in new:
                t.optuna_number = ot.number
            batch += new
        sweep.trials += batch
        sweep.save()
        execute(batch)
        tell_finished()
