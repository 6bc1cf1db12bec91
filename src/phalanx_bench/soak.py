"""Soak benchmark: train for a wall-clock budget and record resident memory and steps/s per update.

    python -m phalanx_bench.soak --minutes 30 --env bucket_brigade --out bench/results/soak.json

Pass: resident set growth under 5% after warm-up (--warmup-minutes, default 5: the allocator's pools
and the first checkpoint and TensorBoard buffers are filled by then) and steps/s that does
not drift (the last quarter's median within 10% of the second quarter's). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from phalanx.config import resolve
from phalanx.trainer import Trainer


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--env", default="bucket_brigade")
    p.add_argument("--num-envs", type=int, default=256)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    p.add_argument("--warmup-minutes", type=float, default=5.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="phalanx-soak-") as tmp:
        cfg = resolve({"env": args.env, "num_envs": args.num_envs, "total_steps": 10**12, "run_dir": tmp,
                       "progress": False, "tensorboard": args.tensorboard, "checkpoint_every": 200_000, "torch_threads": args.threads})
        trainer = Trainer(cfg)
        samples: list[dict[str, float]] = []
        runner = threading.Thread(target=trainer.train, daemon=True)
        t0 = time.time()
        runner.start()
        try:
            while time.time() - t0 < args.minutes * 60 and runner.is_alive():
                time.sleep(2.0)
                if trainer.history:
                    row = trainer.history[-1]
                    samples.append({"t": time.time() - t0, "step": row["step"], "sps": row["sps"], "rss": rss_bytes()})
        finally:
            trainer.run.cfg.total_steps = 0  # the loop stops after the update in progress
            runner.join()
            trainer.close()
    n = len(samples)
    warmup_s = min(args.warmup_minutes * 60, samples[-1]["t"] / 2)
    warm = [s for s in samples if s["t"] >= warmup_s]
    rss0, rss_max = warm[0]["rss"], max(s["rss"] for s in warm)
    q2 = [s["sps"] for s in samples[n // 4: n // 2]]
    q4 = [s["sps"] for s in samples[3 * n // 4:]]
    result = {
        "env": args.env, "num_envs": args.num_envs, "minutes": args.minutes, "updates": n, "steps": samples[-1]["step"],
        "warmup_minutes": warmup_s / 60, "rss_growth_after_first_10pct": max(s["rss"] for s in samples[max(1, n // 10):]) / samples[max(1, n // 10)]["rss"] - 1,
        "rss_after_warmup_mib": rss0 / 2**20, "rss_max_mib": rss_max / 2**20, "rss_growth": rss_max / rss0 - 1,
        "sps_q2_median": statistics.median(q2), "sps_q4_median": statistics.median(q4),
        "sps_drift": statistics.median(q4) / statistics.median(q2) - 1,
        "rss_by_quarter_mib": [samples[min(n - 1, i * n // 4)]["rss"] / 2**20 for i in range(1, 5)],
    }
    result["pass"] = result["rss_growth"] < 0.05 and abs(result["sps_drift"]) < 0.10
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
