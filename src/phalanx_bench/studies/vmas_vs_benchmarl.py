"""Phalanx MAPPO against BenchMARL MAPPO on VMAS tasks: same task settings, frames, seeds and machine.

    pip install -e '.[benchmarl]' && pip install --no-deps benchmarl==1.5.2    # torch left as it is
    python -m phalanx_bench.studies.vmas_vs_benchmarl --tasks navigation,balance --seeds 1,2 --frames 360000
    python -m phalanx_bench.studies.vmas_vs_benchmarl --device cuda --frames 10020000        # BenchMARL's 10M (167 batches)

Every (library, task, seed) trains in its own process, one after the other, with the same torch thread
count (`--threads`, for both: Phalanx's torch_threads is set from it; each result records the threads its
library ran with). BenchMARL runs its tuned VMAS MAPPO (600 worlds x 100 steps a batch, MLP 256x256 tanh, lr 5e-5,
gamma 0.9, lambda 0.9, 45 passes over 15 minibatches, shared parameters, critic on all observations) on its
task settings (conf/task/vmas/<task>.yaml). Phalanx runs `--env vmas:<task>` on its own defaults for the
task (src/phalanx/envs/adapters/vmas.py). Both are evaluated every `--eval-every` frames the way BenchMARL
evaluates: `--eval-episodes` fresh episodes with deterministic actions, each cut at its first done, the
reward summed over the episode and averaged over agents and episodes. The clock is training time only:
BenchMARL's evaluations are subtracted from its wall-clock; Phalanx's policies are evaluated after training
from checkpoints written at the same frames (each checkpoint's time is read from the run's metrics).

Phalanx trains `--phalanx-frames` (default twice `--frames`) so the table can say when it reaches BenchMARL's
final return; its return at BenchMARL's frame budget is read from the same run (its learning rate, annealed
over the longer run, is then still at half: no advantage to Phalanx).

The cost of the machinery, apart from how many passes each library makes: per batch, the collection plus
one optimisation pass over the batch (the batch's update time, GAE included, divided by its passes), averaged
over the run's batches; BenchMARL's from its callbacks, Phalanx's from the trainer's phase clock. Each
library's process is set up as its own command sets it up (Phalanx's: `phalanx train`'s host allocator
settings, `devices.tune_host_allocator`). This module runs BenchMARL's side and the tables and never imports phalanx;
Phalanx's side (its runs, `--score`, `--heuristic`, random play) is `phalanx_bench.studies.vmas_phalanx`, which it
starts in processes of their own.

Writes OUT/<library>-<task>-<seed>/result.json (each run: its curve and times), OUT/runs.json and
OUT/random_play.json (all of them), OUT/table.md and OUT/curves.png. A study is kept packed (phalanx_bench/packs.py):
`python -m phalanx_bench.packs OUT OUT/runs.jsonl.gz --runs '*/result.json'`; `--out OUT/runs.jsonl.gz` then makes table.md
and curves.png again beside the pack from the runs it holds, and trains nothing:

    python -m phalanx_bench.studies.vmas_vs_benchmarl --tasks transport,wheel --seeds 1,2 --frames 720000 --phalanx-frames 720000 \
        --threads 1 --out bench/results/vmas_vs_benchmarl-720k/runs.jsonl.gz
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from phalanx_bench import packs
from phalanx_bench.checkout import RESULTS

LIBRARIES = ("benchmarl", "phalanx")
# BenchMARL's tuned on-policy settings for VMAS (its fine_tuned/vmas configuration and paper).
BATCH_FRAMES, WORLDS, PASSES, MINIBATCH = 60_000, 600, 45, 4_000
PHALANX_SIDE = "phalanx_bench.studies.vmas_phalanx"  # Phalanx's runs and scores (phalanx_side below)


# ---------------------------------------------------------------------------------------------- one run
def eval_return(rollout_rewards, dones) -> float:
    """BenchMARL's evaluation return: per episode, rewards summed up to the first done, averaged over agents;
    then the mean over episodes. rollout_rewards [E, T, A], dones [E, T] bool."""
    first = torch.where(dones.any(1), dones.float().argmax(1), torch.full((dones.shape[0],), dones.shape[1] - 1))
    keep = torch.arange(dones.shape[1])[None, :] <= first[:, None]
    per_episode = (rollout_rewards * keep[..., None]).sum(1).mean(-1)
    return float(per_episode.mean())


def make_recorder():
    """A BenchMARL callback (`Recorder` below); BenchMARL is imported here only, so that the Phalanx runs train
    without TorchRL loaded in their process."""
    from benchmarl.experiment.callback import Callback

    global Recorder  # BenchMARL pickles its callbacks with the experiment: a module-level name pickle can find

    class Recorder(Callback):
        """BenchMARL's evaluations as (frames, training seconds, return); evaluation time is off the clock.
        Per batch, the collection (from the end of the last batch's training or evaluation to the batch) and the
        training (from the batch to the end of its optimisation passes) in seconds."""

        def __init__(self) -> None:
            super().__init__()
            self.curve: list[dict] = []
            self.start = self.eval_start = self.eval_seconds = 0.0
            self.collect_seconds: list[float] = []
            self.train_seconds: list[float] = []
            self.last_end = self.collected = 0.0

        def on_setup(self) -> None:
            self.start = self.last_end = time.perf_counter()

        def on_batch_collected(self, batch) -> None:
            self.collected = time.perf_counter()
            self.collect_seconds.append(self.collected - self.last_end)

        def on_train_end(self, training_td, group: str) -> None:
            self.last_end = time.perf_counter()
            self.train_seconds.append(self.last_end - self.collected)

        def on_evaluation_end(self, rollouts) -> None:
            rewards = [r.get(("next", "agents", "reward")).squeeze(-1) for r in rollouts]
            dones = [r.get(("next", "done")).reshape(r.batch_size[0], -1).any(-1) for r in rollouts]
            rew = torch.nn.utils.rnn.pad_sequence(rewards, batch_first=True)
            done = torch.nn.utils.rnn.pad_sequence(dones, batch_first=True, padding_value=True)
            now = time.perf_counter()
            self.curve.append({"frames": int(self.experiment.total_frames), "time": self.eval_start - self.start - self.eval_seconds,
                               "return": eval_return(rew.float().cpu(), done.cpu())})
            self.eval_seconds += now - self.eval_start
            self.last_end = now

    Recorder.__qualname__ = "Recorder"
    return Recorder()


def run_benchmarl(task: str, seed: int, frames: int, eval_every: int, episodes: int, device: str, out: Path) -> dict:
    from benchmarl.algorithms import MappoConfig
    from benchmarl.environments import VmasTask
    from benchmarl.experiment import Experiment, ExperimentConfig
    from benchmarl.models.mlp import MlpConfig

    cfg = ExperimentConfig.get_from_yaml()
    cfg.sampling_device = cfg.train_device = cfg.buffer_device = device
    cfg.max_n_frames = frames
    cfg.gamma, cfg.lr = 0.9, 5e-5
    cfg.on_policy_collected_frames_per_batch = BATCH_FRAMES
    cfg.on_policy_n_envs_per_worker = WORLDS
    cfg.on_policy_n_minibatch_iters = PASSES
    cfg.on_policy_minibatch_size = MINIBATCH
    cfg.share_policy_params = True
    cfg.evaluation, cfg.evaluation_interval, cfg.evaluation_episodes = True, eval_every, episodes
    cfg.evaluation_deterministic_actions, cfg.render = True, False
    # No logger: evaluations still run where create_json is on (BenchMARL evaluates only when something records them).
    cfg.loggers, cfg.create_json, cfg.checkpoint_interval, cfg.checkpoint_at_end = [], True, 0, False
    cfg.save_folder = str(out)
    algorithm = MappoConfig.get_from_yaml()  # lambda 0.9, clip 0.2, no entropy bonus, shared critic
    recorder = make_recorder()
    experiment = Experiment(task=VmasTask[task.upper()].get_from_yaml(), algorithm_config=algorithm,
                            model_config=MlpConfig.get_from_yaml(), critic_model_config=MlpConfig.get_from_yaml(),
                            seed=seed, config=cfg, callbacks=[recorder])
    evaluation = experiment._evaluation_loop

    def timed_evaluation() -> None:
        recorder.eval_start = time.perf_counter()
        evaluation()

    experiment._evaluation_loop = timed_evaluation
    experiment.run()
    used = torch.get_num_threads()  # BenchMARL leaves torch's threads as the process set them
    total = time.perf_counter() - recorder.start - recorder.eval_seconds
    return {"curve": recorder.curve, "train_seconds": total, "frames": int(experiment.total_frames),
            "passes": PASSES, "collect_seconds": statistics.fmean(recorder.collect_seconds),
            "update_seconds": statistics.fmean(recorder.train_seconds),
            "torch_threads": {"collect": used, "update": used}}


def per_pass(run: dict) -> float:
    """Seconds of one batch's collection plus one optimisation pass over it (GAE shared out over the passes)."""
    return run["collect_seconds"] + run["update_seconds"] / run["passes"]


# ---------------------------------------------------------------------------------------------- report
def interval(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "-"
    return f"{statistics.fmean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def time_to_reach(curve: list[dict], target: float) -> float | None:
    return next((p["time"] for p in curve if p["return"] >= target), None)


def at_frames(curve: list[dict], frames: int) -> dict:
    return [p for p in curve if p["frames"] <= frames][-1]


def kept_results(source: Path) -> dict[str, dict]:
    """Each kept run's result.json by its folder's name (<library>-<task>-<seed>), from a pack (phalanx_bench/packs.py) or
    from a study's folder."""
    return {run["name"]: run["result.json"] for run in packs.runs(source, "*/result.json")}


def report(runs: list[dict], out: Path, tasks: list[str], seeds: list[int], frames: int, device: str,
           random_play: Sequence[dict] = (), episodes: int = 200) -> str:
    """table.md and curves.png into `out`; the table's text."""
    text = table(runs, tasks, seeds, frames, device, random_play, episodes)
    (out / "table.md").write_text(text)
    plot(runs, out / "curves.png", tasks)
    return text


def table(runs: list[dict], tasks: list[str], seeds: list[int], frames: int, device: str,
          random_play: Sequence[dict] = (), episodes: int = 200) -> str:
    lines = [f"VMAS MAPPO, BenchMARL {frames:,} frames, seeds {', '.join(map(str, seeds))}, device {device}; "
             f"return: mean episode reward per agent (BenchMARL's evaluation, {episodes} episodes), mean [min, max] over seeds; "
             "random play: uniform actions, the same evaluation.", "",
             f"| task | library | return at {frames:,} frames | random play | train wall-clock to {frames:,} frames (s) | "
             "frames/s | return at the run's end (frames) | time to BenchMARL's final return | collection + one pass (s) | "
             "vs BenchMARL |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for task in tasks:
        rand = interval([r["return"] for r in random_play if r["task"] == task])
        by = {lib: [r for r in runs if r["task"] == task and r["library"] == lib] for lib in LIBRARIES}
        bm_final = statistics.fmean(r["curve"][-1]["return"] for r in by["benchmarl"]) if by["benchmarl"] else None
        bm_time = statistics.fmean(r["train_seconds"] for r in by["benchmarl"]) if by["benchmarl"] else None
        bm_pass = statistics.fmean(per_pass(r) for r in by["benchmarl"]) if by["benchmarl"] else None
        for lib in LIBRARIES:
            rs = by[lib]
            if not rs:
                continue
            passes = [per_pass(r) for r in rs]
            pass_cell = (f"{statistics.fmean(passes):.2f} ({statistics.fmean(r['collect_seconds'] for r in rs):.2f} + "
                         f"{statistics.fmean(r['update_seconds'] / r['passes'] for r in rs):.2f})")
            ratio = f"{statistics.fmean(passes) / bm_pass:.2f}x" if bm_pass else "-"
            same = [at_frames(r["curve"], frames) for r in rs]
            ends = [r["curve"][-1]["return"] for r in rs]
            fps = [r["frames"] / r["train_seconds"] for r in rs]
            reach = "-"
            if lib == "phalanx" and bm_final is not None:
                times = [time_to_reach(r["curve"], bm_final) for r in rs]
                reach = ", ".join("not reached" if t is None else f"{t:.0f} s ({t / bm_time:.2f}x BenchMARL's)" for t in times)
            lines.append(f"| {task} | {lib} | {interval([p['return'] for p in same])} | {rand} | {interval([p['time'] for p in same])} | "
                         f"{statistics.fmean(fps):,.0f} | {interval(ends)} ({rs[0]['frames']:,}) | {reach} | {pass_cell} | {ratio} |")
    used = {lib: sorted({json.dumps(r.get("torch_threads", "not recorded")) for r in runs if r["library"] == lib})
            for lib in LIBRARIES}
    lines += ["", "torch threads each library ran with: " + "; ".join(f"{lib} {', '.join(v)}" for lib, v in used.items() if v)]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path, tasks: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 7), squeeze=False)
    colors = {"benchmarl": "tab:orange", "phalanx": "tab:blue"}
    for col, task in enumerate(tasks):
        for row, (x, label) in enumerate((("frames", "frames"), ("time", "training wall-clock (s)"))):
            ax = axes[row][col]
            for r in runs:
                if r["task"] != task:
                    continue
                ax.plot([p[x] for p in r["curve"]], [p["return"] for p in r["curve"]], color=colors[r["library"]],
                        alpha=0.8, label=f"{r['library']} seed {r['seed']}", marker="o", markersize=3)
            ax.set_xlabel(label)
            ax.set_ylabel("eval return per agent")
            ax.set_title(f"vmas {task}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """The options of both sides (this module's and `vmas_phalanx`'s, which runs the Phalanx side's modes)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="navigation,balance")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--libraries", default=",".join(LIBRARIES))
    p.add_argument("--frames", type=int, default=360_000, help="frames per BenchMARL run (a multiple of 60,000)")
    p.add_argument("--phalanx-frames", type=int, default=0, help="frames per Phalanx run (0: twice --frames)")
    p.add_argument("--eval-every", type=int, default=120_000, help="frames between evaluations (a multiple of 60,000)")
    p.add_argument("--eval-episodes", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every run")
    p.add_argument("--phalanx-set", default="", help="config keys over Phalanx's defaults, KEY=VALUE,... "
                   "(e.g. mappo_values=per_agent,torch_threads=1 for the settings before issue 30)")
    p.add_argument("--out", default=str(RESULTS / "vmas_vs_benchmarl"), help="[bench/results/vmas_vs_benchmarl]")
    p.add_argument("--one", nargs=3, metavar=("LIBRARY", "TASK", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--heuristic", metavar="TASK", help="score VMAS's own HeuristicPolicy for TASK (e.g. transport) "
                   "by the same protocol on each of --seeds, and print the figures")
    p.add_argument("--score", nargs="+", type=Path, metavar="RUN", help="score Phalanx run directories' latest "
                   "checkpoints by the same protocol (e.g. runs at the full default budget) and write RUN/eval_benchmarl.json")
    return p


def check_threads(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if "torch_threads" in args.phalanx_set:
        p.error("--phalanx-set torch_threads: give --threads, which sets the threads of both libraries")
    if args.threads < 1:
        p.error(f"--threads must be >= 1; got {args.threads}")


def phalanx_side(argv: list[str]) -> int:
    """The Phalanx side's modes (`--one phalanx|random`, `--score`, `--heuristic`) in a process of their own
    (`vmas_phalanx`): this module never imports phalanx, whose import sets OMP_WAIT_POLICY in the environment of every
    process it starts, so that BenchMARL's runs start as they would without Phalanx installed."""
    return subprocess.run([sys.executable, "-m", PHALANX_SIDE, *argv], check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    out = Path(args.out)
    kept = None
    if packs.is_pack(out):  # a kept study: its table again from the pack's runs
        if args.one or args.score or args.heuristic:
            p.error("--out PACK only makes the table again from the runs it holds")
        kept, out = kept_results(out), out.parent
    if args.heuristic or args.score:
        return phalanx_side(argv)
    check_threads(p, args)
    wanted = [args.one[0]] if args.one else args.libraries.split(",")
    if kept is None and "benchmarl" in wanted and importlib.util.find_spec("benchmarl") is None:
        p.error("BenchMARL is not installed: pip install -e '.[benchmarl]' && pip install --no-deps benchmarl==1.5.2")
    if args.one and args.one[0] != "benchmarl":
        return phalanx_side(argv)
    if args.one:
        torch.set_num_threads(args.threads)
        task, seed = args.one[1], int(args.one[2])
        where = out / f"benchmarl-{task}-{seed}"
        where.mkdir(parents=True, exist_ok=True)
        result = run_benchmarl(task, seed, args.frames, args.eval_every, args.eval_episodes, args.device, where)
        (where / "result.json").write_text(json.dumps({"library": "benchmarl", "task": task, "seed": seed, **result}, indent=1))
        return 0
    args.phalanx_frames = args.phalanx_frames or 2 * args.frames
    for value, name in ((args.frames, "--frames"), (args.phalanx_frames, "--phalanx-frames"), (args.eval_every, "--eval-every")):
        if value % BATCH_FRAMES:
            p.error(f"{name} must be a multiple of {BATCH_FRAMES:,} (one batch); got {value:,}")
    tasks, seeds = args.tasks.split(","), [int(s) for s in args.seeds.split(",")]
    runs, random_play = [], []
    for task in tasks:
        for seed in seeds:
            for lib in [*args.libraries.split(","), "random"]:
                name = f"{lib}-{task}-{seed}"
                if kept is not None:
                    if name not in kept:
                        p.error(f"{name} is not in the pack {args.out}")
                    (random_play if lib == "random" else runs).append(kept[name])
                    continue
                result = out / name / "result.json"
                if not result.exists():
                    print(f"{lib} {task} seed {seed} ...", flush=True)
                    module = "phalanx_bench.studies.vmas_vs_benchmarl" if lib == "benchmarl" else PHALANX_SIDE
                    cmd = [sys.executable, "-m", module, "--one", lib, task, str(seed), "--frames", str(args.frames), "--phalanx-frames", str(args.phalanx_frames),
                           "--eval-every", str(args.eval_every), "--eval-episodes", str(args.eval_episodes),
                           "--device", args.device, "--threads", str(args.threads), "--out", str(out),
                           "--phalanx-set", args.phalanx_set]
                    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                (random_play if lib == "random" else runs).append(json.loads(result.read_text()))
    if kept is None:
        (out / "runs.json").write_text(json.dumps(runs, indent=1))
        (out / "random_play.json").write_text(json.dumps(random_play, indent=1))
    print(report(runs, out, tasks, seeds, args.frames, args.device, random_play, args.eval_episodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
