"""Phalanx on the peers' own tables: each peer's published PPO settings, Phalanx's return beside the peer's figure.

    python -m phalanx_bench.studies.learning_parity                                   # every row, 3 seeds each (hours on 2 CPUs)
    python -m phalanx_bench.studies.learning_parity --rows lunarlander_rlzoo --workers 2 --out bench/results/learning_parity

Each row is a sweep spec, `bench/parity/<row>.yaml` (config keys written out, the peer's settings in its comment),
run by `phalanx sweep` into OUT/<row>/ (resumable: run it again and finished runs are kept). Every finished run is
then scored by `phalanx eval RUN --episodes N --json`: greedy play and sampled play, N fresh episodes each (kept in
OUT/<row>/eval/ with the run's training time, so that --report-only makes the table again without the runs).
OUT/table.md: per row (every row OUT holds), Phalanx's mean over seeds with a 95% bootstrap interval over seeds
(`phalanx.compare.bootstrap_ci`) and each seed's figure, greedy and sampled, beside the peer's published figure, what
that figure measures and where it was published, and the training wall time of each run.

The peers' figures are not all measured alike (written in PEERS): CleanRL's are the mean return of the training
episodes (the sampled policy) at the end of training, over 3 seeds; the RL Zoo's are one trained model's
deterministic evaluation (mean and std over its evaluation episodes). Compare sampled play with the first and
greedy play with the second.

Kept packed (phalanx_bench/packs.py): each row's sweep.json and eval/ as one line of OUT/runs.jsonl.gz,
`python -m phalanx_bench.packs OUT OUT/runs.jsonl.gz --runs '*/sweep.json' --files sweep.json --files 'eval/*.json'`. A row
OUT holds no folder of is read from OUT/runs.jsonl.gz, so `--report-only` makes OUT/table.md and OUT/results.json
again from the pack; `--out OUT/runs.jsonl.gz` does the same and trains nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.compare import bootstrap_ci
from phalanx_bench import packs
from phalanx_bench.checkout import BENCH, RESULTS

SPECS = BENCH / "parity"
CLEANRL_PPO = "CleanRL docs, rl-algorithms/ppo, ppo.py table (3 seeds)"
CLEANRL_CONT = "CleanRL docs, rl-algorithms/ppo, ppo_continuous_action.py MuJoCo v4 table"
RL_ZOO = "rl-baselines3-zoo benchmark.md (SB3 PPO)"


@dataclass(frozen=True)
class Peer:
    task: str
    name: str
    mean: float
    spread: float  # the +- the peer publishes with its mean
    measure: str  # what the figure is, so that it is compared with the like
    source: str
    budget: str


PEERS = {
    "cartpole_cleanrl": Peer("CartPole-v1", "CleanRL ppo.py", 490.04, 6.12, "training episodes (sampled)", CLEANRL_PPO, "500k"),
    "acrobot_cleanrl": Peer("Acrobot-v1", "CleanRL ppo.py", -86.36, 1.32, "training episodes (sampled)", CLEANRL_PPO, "500k"),
    "lunarlander_rlzoo": Peer("LunarLander-v3", "RL Zoo (SB3)", 242.119, 31.823, "deterministic evaluation, LunarLander-v2",
                              RL_ZOO, "1M"),
    "pendulum_rlzoo": Peer("Pendulum-v1", "RL Zoo (SB3)", -172.225, 104.159, "deterministic evaluation, with gSDE", RL_ZOO,
                           "100k"),
    "halfcheetah_cleanrl": Peer("HalfCheetah-v5", "CleanRL ppo_continuous_action.py", 1442.64, 46.03,
                                "training episodes (sampled), HalfCheetah-v4", CLEANRL_CONT, "1M"),
    "hopper_cleanrl": Peer("Hopper-v5", "CleanRL ppo_continuous_action.py", 2382.86, 271.74,
                           "training episodes (sampled), Hopper-v4", CLEANRL_CONT, "1M"),
    "walker2d_cleanrl": Peer("Walker2d-v5", "CleanRL ppo_continuous_action.py", 2287.95, 571.78,
                             "training episodes (sampled), Walker2d-v4", CLEANRL_CONT, "1M"),
}


def phalanx(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", *args]


def run_row(row: str, specs: Path, out: Path, workers: int) -> None:
    subprocess.run(phalanx("sweep", str(specs / f"{row}.yaml"), "--dir", str(out / row), "--workers", str(workers)),
                   check=True)


def evaluate(run: Path, out: Path, episodes: int) -> dict:
    """`phalanx eval RUN --json` of one finished run (greedy and sampled play), cached in `out`."""
    if out.exists():
        return json.loads(out.read_text())
    done = subprocess.run(phalanx("eval", str(run), "--episodes", str(episodes), "--json"), check=True,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(done.stdout)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def train_seconds(run: Path) -> float:
    """The run's training wall time from its metrics: the first update's time (steps / its rate) and the rest."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows[-1]["time"] - rows[0]["time"] + rows[0]["step"] / rows[0]["sps"]


def kept_rows(source: Path) -> dict[str, dict]:
    """Each row's kept files ("sweep.json", "eval/<trial>.json") by row, from a pack (phalanx_bench/packs.py) or from OUT."""
    return {run["name"]: run for run in packs.runs(source, "*/sweep.json", ("sweep.json", "eval/*.json"))}


def scores(row: str, out: Path, episodes: int, kept: dict | None = None) -> dict | None:
    """A row's figures: its runs evaluated (cached in OUT/<row>/eval/), or, given the row's `kept` files, read."""
    sweep = kept["sweep.json"] if kept is not None else json.loads((out / row / "sweep.json").read_text())
    done = [t for t in sweep["trials"] if t["status"] == "done"]
    if not done:
        return None
    seeds, greedy, sampled, seconds = [], [], [], []
    for trial in sorted(done, key=lambda t: t["seed"]):
        run = out / row / "runs" / trial["name"]
        cached = out / row / "eval" / f"{trial['name']}.json"
        if kept is not None:
            result = kept.get(f"eval/{trial['name']}.json")
            if result is None or "train_seconds" not in result:
                raise SystemExit(f"{row}: {trial['name']}'s evaluation is not in the pack")
        else:
            result = evaluate(run, cached, episodes)
        if "train_seconds" not in result:  # kept beside the scores: the runs themselves are not kept with the results
            result["train_seconds"] = train_seconds(run)
            cached.write_text(json.dumps(result, indent=1))
        seeds.append(trial["seed"])
        greedy.append(result["mean_return"])
        sampled.append(result["sampled_play"]["mean_return"])
        seconds.append(result["train_seconds"])
    return {"seeds": seeds, "greedy": greedy, "sampled": sampled, "train_seconds": seconds}


def cell(values: list[float]) -> str:
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        return f"{x.mean():.1f} (one seed)"
    lo, hi = bootstrap_ci(x, lambda a: float(a.mean()))
    return f"**{x.mean():.1f}** [{lo:.1f}, {hi:.1f}] ({', '.join(f'{v:.1f}' for v in x)})"


def table(results: dict[str, dict], episodes: int) -> str:
    lines = [f"Phalanx at each peer's published PPO settings (`bench/parity/<row>.yaml`); {episodes} evaluation episodes "
             "per seed and mode; mean over seeds [95% bootstrap interval over seeds] (each seed).", "",
             "| task | peer's settings | steps | Phalanx greedy | Phalanx sampled | peer's figure | what the peer's figure is | "
             "training time a run (s) |", "|---|---|---|---|---|---|---|---|"]
    for row, r in results.items():
        peer = PEERS[row]
        lines.append(f"| {peer.task} | {peer.name} | {peer.budget} | {cell(r['greedy'])} | {cell(r['sampled'])} | "
                     f"{peer.mean:.2f} +- {peer.spread:.2f} | {peer.measure}; {peer.source} | "
                     f"{', '.join(f'{s:.0f}' for s in r['train_seconds'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(PEERS), help=f"comma list of rows [{','.join(PEERS)}]")
    p.add_argument("--out", default=str(RESULTS / "learning_parity"), help="results directory [bench/results/learning_parity]")
    p.add_argument("--workers", type=int, default=2, help="runs at a time [2]")
    p.add_argument("--episodes", type=int, default=100, help="evaluation episodes per seed and mode [100]")
    p.add_argument("--report-only", action="store_true", help="score the finished runs; train nothing")
    p.add_argument("--specs", default=str(SPECS), help="directory of the rows' sweep specs [bench/parity]")
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in PEERS]
    if unknown:
        p.error(f"unknown row {unknown[0]!r}; allowed: {', '.join(PEERS)}")
    out = Path(args.out)
    packed = packs.is_pack(out)  # a kept comparison: the table again from the pack, nothing trained
    pack = out if packed else out / "runs.jsonl.gz"
    if packed:
        out = out.parent
    if not args.report_only and not packed:
        for row in rows:
            run_row(row, Path(args.specs), out, args.workers)
    kept = kept_rows(pack) if pack.exists() else {}
    results = {}
    for row in PEERS:  # every row OUT holds, so that training some rows keeps the others in the table
        if (out / row / "sweep.json").exists() or row in kept:  # a row's folder before its packed files
            got = scores(row, out, args.episodes, None if (out / row / "sweep.json").exists() else kept[row])
            if got is not None:
                results[row] = got
    (out / "results.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results, args.episodes)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
