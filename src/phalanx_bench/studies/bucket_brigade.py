"""The bucket_brigade study: in each of the 12 scenarios, learned teams (several seeds) against every
homogeneous archetype team and random play. Reads run directories whose `eval_vs.json` holds
`phalanx eval RUN --episodes N --vs firefighter,free_rider,hero,coordinator,liar,random --json` (N = 200 at a
quarter budget, 1000 at the full one), and writes a Markdown table (and JSON) with 95% intervals.

    phalanx sweep bench/bucket_study.yaml --dir runs/bucket_study --workers 2
    for r in runs/bucket_study/runs/*; do phalanx eval $r --episodes 200 \\
        --vs firefighter,free_rider,hero,coordinator,liar,random --json > $r/eval_vs.json; done
    python -m phalanx_bench.studies.bucket_brigade runs/bucket_study --out bench/results/bucket_study.md
    python -m phalanx_bench.studies.bucket_brigade runs/bucket_study --pack STUDY/runs.jsonl.gz   # to keep, as bench/results/bucket_study_full/

A study is kept packed (`--pack`, phalanx_bench/packs.py): one gzipped JSON line per run, its name and its files (config.json and
every evaluation), read back as the folder was (`python -m phalanx_bench.studies.bucket_brigade PACK.jsonl.gz --out ...`).

Intervals: a scripted team's is the normal 95% interval of its mean episode return over the N
episodes; the learned teams' is a 95% stratified bootstrap over seeds x episodes (each seed's episodes
resampled from a normal with that seed's mean and standard error, then averaged over seeds), so both
the seed-to-seed and the episode-to-episode spread count.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from phalanx_bench import packs
from phalanx.zoo.bucket_brigade import SCENARIOS

TEAMS = ("firefighter", "free_rider", "hero", "coordinator", "liar", "random")


def load(root: Path, evals: str = "eval_vs.json") -> dict[str, list[dict]]:
    """scenario -> the evaluation `evals` of each seed's run (scenarios in the env's order), from `packs.runs(root)`."""
    out: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    for run in packs.runs(root):
        if evals not in run:
            continue
        cfg, data = run["config.json"], run[evals]
        data["seed"] = cfg["seed"]
        out[cfg["env_options"].get("scenario", "default")].append(data)
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in out.items() if v}


def learned_interval(runs: list[dict], reps: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    means = np.array([r["learned"]["mean_return"] for r in runs])
    ses = np.array([r["learned"]["std_return"] / math.sqrt(r["learned"]["episodes"]) for r in runs])
    picks = rng.integers(0, len(runs), size=(reps, len(runs)))
    draws = rng.normal(means[picks], ses[picks]).mean(1)
    lo, hi = np.quantile(draws, [0.025, 0.975])
    return float(means.mean()), float(lo), float(hi)


def scripted_interval(r: dict) -> tuple[float, float, float]:
    half = 1.96 * r["std_return"] / math.sqrt(r["episodes"])
    return r["mean_return"], r["mean_return"] - half, r["mean_return"] + half


def table(data: dict[str, list[dict]]) -> tuple[str, list[dict]]:
    head = "| scenario | seeds | learned (per seed) | " + " | ".join(TEAMS) + " | learning |"
    lines = [head, "|---|---|---|" + "--:|" * len(TEAMS) + "---|"]
    rows = []
    for scenario, runs in data.items():
        mean, lo, hi = learned_interval(runs)
        teams = {t: scripted_interval(runs[0][t]) for t in TEAMS}  # scripted play does not depend on the run
        beaten_by = [t for t, (m, tlo, thi) in teams.items() if m > mean]
        clear = [t for t in beaten_by if teams[t][1] > hi]
        best = max(teams, key=lambda t: teams[t][0])
        verdict = ("**loses** to " + ", ".join(clear) if clear else
                   "below " + ", ".join(beaten_by) + " (intervals overlap)" if beaten_by else
                   f"beats every team (best: {best})")
        per_seed = ", ".join(f"{r['learned']['mean_return']:.0f}" for r in runs)
        cells = " | ".join(f"{m:.0f} [{a:.0f}, {b:.0f}]" for m, a, b in teams.values())
        lines.append(f"| {scenario} | {','.join(str(r['seed']) for r in runs)} | **{mean:.0f}** [{lo:.0f}, {hi:.0f}] "
                     f"({per_seed}) | {cells} | {verdict} |")
        rows.append({"scenario": scenario, "seeds": [r["seed"] for r in runs], "learned": [mean, lo, hi],
                     "learned_per_seed": [r["learned"]["mean_return"] for r in runs],
                     "teams": {t: list(v) for t, v in teams.items()}, "loses_to": clear, "below": beaten_by})
    return "\n".join(lines) + "\n", rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="a folder holding the study's run directories, or a pack (--pack)")
    p.add_argument("--out", type=Path, default=None, help="Markdown file to write (a .json beside it)")
    p.add_argument("--evals", default="eval_vs.json", help="the name of each run's evaluation file [eval_vs.json]")
    p.add_argument("--pack", type=Path, default=None, help="write the runs as one gzipped JSONL file (to keep) and stop")
    args = p.parse_args()
    if args.pack:
        packs.pack(args.root, args.pack)
        return
    md, rows = table(load(args.root, args.evals))
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(md)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
