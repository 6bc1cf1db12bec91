"""`phalanx compare`: runs grouped by configuration, scored over seeds with the statistics rliable
recommends (Agarwal et al., 2021): mean, interquartile mean (IQM) and 95% stratified-bootstrap
confidence intervals; a Markdown and a JSON table, and learning curves with confidence bands.

The statistics are plain numpy functions of a [runs] or [runs, tasks] score array. With one task per
configuration the stratified bootstrap resamples the seeds; with several tasks (`bootstrap_ci` on a
2-D array) it resamples runs within each task, as rliable's StratifiedBootstrap does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from phalanx import runs
from phalanx.errors import PhalanxError
from phalanx.sweep import SWEEP_FILE, run_result

# Keys that differ between runs of one configuration and so never split a group.
NOT_CONFIG = {"seed", "run_dir", "progress", "tensorboard", "device", "torch_threads", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints",
              "wandb", "wandb_project", "wandb_mode"}


# -- statistics (pure) -----------------------------------------------------------------------------
def iqm(scores: np.ndarray) -> float:
    """Interquartile mean: the mean of the middle 50% of the scores (25% trimmed at each end; of the
    scores pooled over tasks for a 2-D array), rliable's aggregate of choice."""
    x = np.sort(np.asarray(scores, dtype=np.float64).reshape(-1))
    n = len(x)
    cut = int(np.floor(0.25 * n))
    return float(x[cut:n - cut].mean()) if n - 2 * cut > 0 else float(x.mean())


def bootstrap_ci(scores: np.ndarray, statistic: Callable[[np.ndarray], float], reps: int = 2000,
                 confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of `statistic` over stratified bootstrap resamples: runs are drawn with
    replacement within each task (column) of a [runs, tasks] array (a 1-D array is one task)."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    rng = np.random.default_rng(seed)
    n = x.shape[0]
    stats = np.empty(reps)
    cols = np.arange(x.shape[1])
    for i in range(reps):
        rows = rng.integers(0, n, size=x.shape)
        stats[i] = statistic(x[rows, cols])
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(stats, [alpha, 1 - alpha])
    return float(lo), float(hi)


def summarise(scores: list[float]) -> dict[str, Any]:
    x = np.asarray(scores, dtype=np.float64)
    mean_ci = bootstrap_ci(x, lambda a: float(a.mean()))
    iqm_ci = bootstrap_ci(x, iqm)
    return {"runs": len(x), "mean": float(x.mean()), "mean_ci": list(mean_ci), "iqm": iqm(x), "iqm_ci": list(iqm_ci),
            "std": float(x.std(ddof=1)) if len(x) > 1 else 0.0, "min": float(x.min()), "max": float(x.max())}


# -- loading ---------------------------------------------------------------------------------------
@dataclass
class Group:
    label: str
    config: dict[str, Any]
    runs: list[Path] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories named, those of a sweep, or every run directory below a folder."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "config.json").is_file():
            found.append(p)
        elif (p / SWEEP_FILE).is_file():
            found += sorted(d for d in (p / "runs").iterdir() if (d / "config.json").is_file())
        elif p.is_dir():
            found += sorted(c.parent for c in p.rglob("config.json") if c.parent.name != "configs")
        else:
            raise PhalanxError(f"'{p}' is not a run directory, a sweep directory or a folder of runs")
    if not found:
        raise PhalanxError(f"no run directories under {', '.join(map(str, paths))}")
    return list(dict.fromkeys(found))


def group_runs(run_dirs: list[Path], metric: str) -> list[Group]:
    """Runs with equal configs (all but seeds and housekeeping keys) form a group, labelled by the keys
    that differ between groups. Runs without a score (unfinished) are left out."""
    configs = {d: json.loads((d / "config.json").read_text()) for d in run_dirs}
    keyed: dict[str, Group] = {}
    for d, cfg in configs.items():
        core = {k: v for k, v in cfg.items() if k not in NOT_CONFIG}
        key = json.dumps(core, sort_keys=True)
        g = keyed.setdefault(key, Group("", core))
        score = run_result(d, metric)
        if score is not None:
            g.runs.append(d)
            g.scores.append(score)
            g.seeds.append(int(cfg.get("seed", 0)))
    groups = [g for g in keyed.values() if g.scores]
    if not groups:
        raise PhalanxError(f"no finished run has '{metric}' (eval.json for eval_*, else metrics.jsonl); "
                           + metrics_on_offer(run_dirs))
    differing = sorted(k for k in set().union(*(g.config for g in groups))
                       if len({json.dumps(g.config.get(k)) for g in groups}) > 1)
    for g in groups:
        g.label = ", ".join(f"{k}={g.config.get(k)}" for k in differing) or str(g.config.get("env", "runs"))
    return groups


def metrics_on_offer(run_dirs: list[Path]) -> str:
    """What the runs do have to compare on, for the line that says what they lack (runs trained with
    --eval-episodes 0 have no eval.json, but every run has its metrics rows)."""
    have: dict[str, None] = {}
    for d in run_dirs:
        ev = d / "eval.json"
        if ev.is_file():
            have.update((f"eval_{k}", None) for k, v in json.loads(ev.read_text()).items() if isinstance(v, (int, float)))
        rows = runs.read_metrics(d)
        if rows:
            have.update((k, None) for k, v in rows[-1].items() if isinstance(v, (int, float)) and k not in ("step", "update"))
    if not have:
        return "the runs have no metrics yet"
    best = next((k for k in ("eval_mean_return", "episode_return", "team_return") if k in have), next(iter(have)))
    return f"they have {', '.join(list(have)[:8])}{', ...' if len(have) > 8 else ''}: e.g. --metric {best}"


def duplicate_seeds(group: Group) -> dict[int, list[Path]]:
    """Seeds that more than one run of a group trained with: one experiment counted twice, which narrows the
    interval without new evidence."""
    by_seed: dict[int, list[Path]] = {}
    for seed, run in zip(group.seeds, group.runs):
        by_seed.setdefault(seed, []).append(run)
    return {seed: found for seed, found in by_seed.items() if len(found) > 1}


# -- outputs ---------------------------------------------------------------------------------------
def compare_table(groups: list[Group], metric: str) -> tuple[str, list[dict[str, Any]]]:
    rows = [{"config": g.label, "seeds": g.seeds, **summarise(g.scores), "scores": g.scores,
             "runs_dirs": [str(r) for r in g.runs],
             "duplicate_seeds": {str(k): [str(r) for r in v] for k, v in duplicate_seeds(g).items()}} for g in groups]
    lines = [f"{metric} over seeds; 95% stratified-bootstrap confidence intervals (2000 resamples)", "",
             "| config | seeds | mean | 95% CI | IQM | 95% CI | min | max |", "|---|---|--:|---|--:|---|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {','.join(map(str, r['seeds']))} | {r['mean']:.2f} | [{r['mean_ci'][0]:.2f}, "
                     f"{r['mean_ci'][1]:.2f}] | {r['iqm']:.2f} | [{r['iqm_ci'][0]:.2f}, {r['iqm_ci'][1]:.2f}] | "
                     f"{r['min']:.2f} | {r['max']:.2f} |")
    dupes = [(r["config"], seed, found) for r in rows for seed, found in r["duplicate_seeds"].items()]
    if dupes:
        lines.append("")
        lines += [f"duplicates: {config} has seed {seed} in {len(found)} runs ({', '.join(found)}); each is counted, "
                  f"so its interval is narrower than its evidence" for config, seed, found in dupes]
    return "\n".join(lines) + "\n", rows


def curves_plot(groups: list[Group], out: Path, key: str = "episode_return", points: int = 100) -> Path:
    """Mean learning curve per group with a 95% bootstrap band over its seeds (curves interpolated onto
    one step grid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for g in groups:
        curves = []
        for run in g.runs:
            pts = [(r["step"], r[key]) for r in runs.read_metrics(run) if r.get(key) is not None]
            if len(pts) > 1:
                curves.append(np.asarray(pts, dtype=np.float64))
        if not curves:
            continue
        end = min(c[-1, 0] for c in curves)
        grid = np.linspace(max(c[0, 0] for c in curves), end, points)
        ys = np.stack([np.interp(grid, c[:, 0], c[:, 1]) for c in curves])  # [seeds, points]
        mean = ys.mean(0)
        band = np.array([bootstrap_ci(ys[:, i], lambda a: float(a.mean()), reps=500) for i in range(points)])
        ax.plot(grid, mean, lw=1.6, label=f"{g.label} ({len(curves)} seeds)")
        ax.fill_between(grid, band[:, 0], band[:, 1], alpha=0.2)
    ax.set(xlabel="steps", ylabel=key.replace("_", " "), title="mean over seeds, 95% bootstrap band")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def compare(paths: list[str | Path], metric: str = "eval_mean_return", out_dir: Path | None = None) -> dict[str, Any]:
    """Group, score and write compare.md, compare.json and curves.png into `out_dir`; returns the JSON."""
    groups = group_runs(find_runs(paths), metric)
    markdown, rows = compare_table(groups, metric)
    out_dir = Path(out_dir) if out_dir is not None else default_out(paths)
    with runs.writing("comparison", out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "compare.md").write_text(markdown)
        png = curves_plot(groups, out_dir / "curves.png")
        result = {"metric": metric, "groups": rows, "markdown": str(out_dir / "compare.md"), "plot": str(png)}
        (out_dir / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    return result | {"table": markdown}


def default_out(paths: list[str | Path]) -> Path:
    """Where `compare` writes unless told: into the one sweep or folder of runs it was given (<it>/compare),
    else beside the runs (<their common folder>/compare), never the current directory by accident."""
    dirs = [Path(p) for p in paths]
    if len(dirs) == 1 and not (dirs[0] / "config.json").is_file():
        return dirs[0] / "compare"
    parents = [d.resolve().parent if (d / "config.json").is_file() else d.resolve() for d in dirs]
    return Path(os.path.commonpath(parents)) / "compare"
