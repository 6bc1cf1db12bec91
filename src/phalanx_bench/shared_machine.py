"""`phalanx train` on a machine where something else runs: the default thread count against one thread.

Starts `--busy` CPU-bound processes (a Python busy loop each), then times whole `phalanx train` processes
in alternation: the default (torch_threads 0, chosen from the work), `--torch-threads 1`, and
`--torch-threads <CPUs>` (what torch picks on its own, the default before the choice existed). Prints
each time and each variant's median over pairs, divided by the one-thread median.

    python -m phalanx_bench.shared_machine                          # cartpole's default run (200k steps), 3 pairs
    python -m phalanx_bench.shared_machine --pairs 3 --busy 1 --args "--env cartpole --num-envs 4096 --num-steps 32 --total-steps 1000000"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY_LOOP = "while True: pass"


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"shared_machine: {' '.join(cmd[:8])} ... failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--args", default="--env cartpole", help="phalanx train arguments [--env cartpole]")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--busy", type=int, default=1, help="CPU-bound processes running beside it [1]")
    p.add_argument("--out", default=None, help="write results.json here")
    args = p.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    variants = {"default": [], "one thread": ["--torch-threads", "1"], f"{cpus} threads (torch's own)": ["--torch-threads", str(cpus)]}
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy)]
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for i in range(args.pairs):
            for name, extra in variants.items():
                with tempfile.TemporaryDirectory() as tmp:
                    cmd = [sys.executable, "-m", "phalanx", "train", *shlex.split(args.args), *extra, "--progress", "false",
                           "--tensorboard", "false", "--device", "cpu", "--run-dir", f"{tmp}/run"]
                    times[name].append(timed(cmd))
                print(f"round {i + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    finally:
        for b in busy:
            b.kill()
    one = statistics.median(times["one thread"])
    print(f"\n`phalanx train {args.args}` beside {args.busy} busy process(es), {cpus} CPUs, {args.pairs} rounds in alternation:")
    print("| variant | median s | times s | / one thread |\n|---|--:|---|--:|")
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"times": [round(t, 2) for t in ts], "median": round(med, 2), "over_one_thread": round(med / one, 3)}
        print(f"| {name} | {med:.1f} | {', '.join(f'{t:.1f}' for t in ts)} | {med / one:.2f}x |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps({"args": args.args, "busy": args.busy, "cpus": cpus, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
