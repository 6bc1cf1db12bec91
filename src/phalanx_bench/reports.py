"""What `phalanx bench` prints and writes: the number formats, the tables of each target, the suite's bench.md and
bench.png, and the update-cycle profile's tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def fmt_sps(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


COLUMNS = [("num_envs", 8), ("env", 9), ("rollout", 9), ("train", 9), ("ref train", 10), ("train/ref", 9), ("others", 6)]
BB_COLUMNS = [("num_envs", 8), ("env", 9), ("rollout", 9), ("train", 9), ("others", 6)]
SUITE_COLUMNS = [("workload", 14), ("num_envs", 8), ("env-only", 9), ("training", 9), ("peak mem", 10), ("others", 6)]
BUSY_WARN = 0.10


def table_line(values: list[str], columns: list[tuple[str, int]] = COLUMNS) -> str:
    return "  ".join(v.rjust(w) for v, (_, w) in zip(values, columns))


def print_header(columns: list[tuple[str, int]]) -> None:
    header = table_line([name for name, _ in columns], columns)
    print(header)
    print("-" * len(header), flush=True)


def fmt_busy(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def warn_busy(rows: list[dict[str, Any]]) -> None:
    worst = max((r["others_busy"] or 0.0 for r in rows), default=0.0)
    if worst > BUSY_WARN:
        print(f"warning: other processes used up to {worst:.0%} of the CPUs during these measurements; "
              "the numbers are not reliable (torch's threads stall when one is descheduled); rerun on an idle machine")


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MiB"


def sps_of(m: dict | None) -> float | None:
    return m["sps"] if m else None


def suite_line(row: dict[str, Any]) -> str:
    mem = row["peak_memory"]["bytes"] if row["peak_memory"] else None
    cells = [row["workload"], str(row["num_envs"]), fmt_sps(sps_of(row["env"])), fmt_sps(sps_of(row["train"])), fmt_bytes(mem),
             fmt_busy(row["others_busy"])]
    extra = [f"{m} {fmt_sps(sps_of(v['train']))}" + (f" ({fmt_bytes(v['peak_memory']['bytes'])})" if v["peak_memory"] else "")
             for m, v in row.get("modes", {}).items() if m != "eager"]
    if row.get("ref"):
        extra.append(f"minimal loop {fmt_sps(row['ref']['sps'])}")
    notes = [row["note"]] if row["note"] else []
    notes += [f"{m}: {v['note']}" for m, v in row.get("modes", {}).items() if v.get("note")]
    return table_line(cells, SUITE_COLUMNS) + ("  " + "; ".join(extra) if extra else "") + ("  " + "; ".join(notes) if notes else "")


def machine_line(m: dict[str, Any]) -> str:
    return (f"{m['cpu_model']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads, torch {m['torch']}, "
            f"device {m['device']}, Python {m['python']}")


def suite_markdown(result: dict[str, Any]) -> str:
    """bench.md: the machine line, the rows, the SB3 comparison and the profile."""
    m = result["machine"]
    lines = ["# phalanx bench suite", "", f"Machine: {machine_line(m)}", "",
             f"Rates are agent-steps/s (env steps x num_agents, summed over envs; the fastest 0.25 s window of "
             f"{result['settings']['seconds']:g} s after one warm-up iteration). Training runs collect + update with "
             "the workload's own training config. Peak memory: "
             + _memory_text(result["rows"]) + " Fits: the largest num_envs whose buffers fit in 80% of the device's "
             "free memory, by the trainer's own check (and the pieces each minibatch runs in, update_chunks).", "",
             ]
    modes = [m for m in result["settings"].get("modes", ["eager"]) if m != "eager"]
    ref = any(r.get("ref") for r in result["rows"])
    head = ["workload", "agents", "steps", "model", "num_envs", "env-only", "training"] + modes + (["minimal loop"] if ref else [])
    lines += ["| " + " | ".join(head + ["peak memory", "fits", "note"]) + " |",
              "|---|--:|--:|---|" + "--:|" * (len(head) - 4) + "--:|--:|---|"]
    for r in result["rows"]:
        w = result["workloads"][r["workload"]]
        mem = r["peak_memory"]["bytes"] if r["peak_memory"] else None
        got = r.get("modes", {})
        cells = [fmt_sps(sps_of(got[m]["train"])) if m in got else "" for m in modes]
        if ref:
            cells.append(fmt_sps(sps_of(r.get("ref"))))
        mems = [fmt_bytes(mem)] + [f"{m} {fmt_bytes(got[m]['peak_memory']['bytes'])}" for m in modes
                                    if m in got and got[m]["peak_memory"]]
        notes = ([r["note"]] if r["note"] else []) + [f"{m}: {got[m]['note']}" for m in modes if m in got and got[m].get("note")]
        lines.append(f"| {r['workload']} | {w['num_agents']} | {w['num_steps']} | {w['model']} | {r['num_envs']} | "
                     f"{fmt_sps(sps_of(r['env']))} | {fmt_sps(sps_of(r['train']))} | " + "".join(f"{c} | " for c in cells)
                     + f"{', '.join(mems)} | {_fits(r)} | {'; '.join(notes)} |")
    sb3 = result.get("sb3")
    if sb3:
        ratio = f" = {sb3['phalanx_over_sb3']:.1f}x SB3" if sb3["phalanx_over_sb3"] else ""
        lines += ["", f"Stable-Baselines3 {sb3['version']} PPO (defaults, {sb3['num_envs']} envs, CPU) on CartPole-v1: "
                      f"{fmt_sps(sb3['sps'])} steps/s; phalanx cartpole training at {sb3['phalanx_num_envs']} envs: "
                      f"{fmt_sps(sb3['phalanx_sps'])} steps/s{ratio}."]
    if result.get("profile"):
        lines += ["", "## Update-cycle profile", "", profile_markdown(result["profile"])]
    return "\n".join(lines) + "\n"


def _fits(row: dict[str, Any]) -> str:
    """The largest num_envs whose run fits in 80% of the device's free memory, and the pieces each minibatch
    runs in where that is more than one (update_chunks)."""
    train = row["train"] or {}
    if train.get("most_envs") is None:
        return ""
    chunks = train.get("update_chunks", 1)
    return f"{train['most_envs']:,}" + (f" ({chunks} pieces)" if chunks > 1 else "")


def _memory_text(rows: list[dict[str, Any]]) -> str:
    methods = {r["peak_memory"]["method"] for r in rows if r["peak_memory"]}
    texts = {
        "rss_peak_growth": "growth of the process's peak resident set (VmHWM/ru_maxrss, reset before each row) over "
                           "its resident set at the row's start",
        "ru_maxrss_growth": "how far the row raised the process's ru_maxrss (0 when below an earlier peak)",
        "cuda_max_memory_allocated": "torch.cuda.max_memory_allocated during the row (tensors only)",
        "unavailable": "not measured on this device",
    }
    return "; ".join(texts[k] for k in sorted(methods)) + "." if methods else "-."


def write_plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """bench.png: env-only and training agent-steps/s against num_envs, log-log, one line per workload.
    False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in zip(axes, ("env", "train"), ("env only", "training")):
        for name in dict.fromkeys(r["workload"] for r in rows):
            pts = [(r["num_envs"], r[key]["sps"]) for r in rows if r["workload"] == name and r[key]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        if ax.lines:
            ax.legend(fontsize=8)
        ax.set(xscale="log", yscale="log", xlabel="num_envs", ylabel="agent-steps/s", title=label)
        counts = sorted({r["num_envs"] for r in rows})
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_suite_files(result: dict[str, Any], out_dir: Path) -> dict[str, str | None]:
    """Print the Markdown table and write DIR/bench.md and DIR/bench.png; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = suite_markdown(result)
    print()
    print(md, end="")
    (out_dir / "bench.md").write_text(md)
    png = out_dir / "bench.png"
    plotted = write_plot(result["rows"], png, "phalanx bench suite: " + machine_line(result["machine"]))
    print(f"\nwrote {out_dir / 'bench.md'}" + (f" and {png}" if plotted else " (no plot: matplotlib is not installed)"))
    return {"markdown": str(out_dir / "bench.md"), "plot": str(png) if plotted else None}


PROFILE_PARTS = [("env_step", "env step"), ("policy_forward", "policy forward"), ("opponents", "opponents"),
                 ("rollout_other", "rollout other"), ("gae", "GAE"), ("update", "update")]


def profile_table(p: dict[str, Any]) -> str:
    """One workload's split as a plain-text table: seconds per cycle and share of the cycle per part."""
    if p["note"]:
        return f"{p['workload']} at {p['num_envs']} envs: {p['note']}"
    lines = [f"{p['workload']}: {p['num_envs']} envs x {p['num_steps']} steps x {p['num_agents']} agents, "
             f"{p['cycles']} cycle(s) of {p['cycle_seconds']:.3f} s",
             f"  {'part':<16}{'seconds':>9}{'share':>8}"]
    lines += [f"  {label:<16}{p['parts'][k]:>9.4f}{p['fractions'][k]:>8.1%}" for k, label in PROFILE_PARTS]
    lines.append(f"  {'cycle':<16}{p['cycle_seconds']:>9.4f}{1:>8.1%}")
    lines.append(f"  model compute (policy forward + update): {p['model_fraction']:.1%}")
    return "\n".join(lines)


def profile_markdown(profiles: list[dict[str, Any]]) -> str:
    """All workloads' splits as one Markdown table: seconds per cycle (share of the cycle) per part."""
    head = "| workload | num_envs | cycle | " + " | ".join(label for _, label in PROFILE_PARTS) + " | model compute |"
    lines = [head, "|---|--:|--:|" + "--:|" * (len(PROFILE_PARTS) + 1)]
    for p in profiles:
        if p["note"]:
            lines.append(f"| {p['workload']} | {p['num_envs']} | {p['note']} |" + " |" * (len(PROFILE_PARTS) + 1))
            continue
        cells = [f"{p['parts'][k]:.3f} s ({p['fractions'][k]:.0%})" for k, _ in PROFILE_PARTS]
        lines.append(f"| {p['workload']} | {p['num_envs']} | {p['cycle_seconds']:.3f} s | " + " | ".join(cells)
                     + f" | {p['model_fraction']:.0%} |")
    lines += ["", "Parts per cycle: env step (`env.step`), policy forward (the rollout's actor and critic forwards), "
                  "opponents (league/teammate actions), rollout other (buffers, normalisers, bookkeeping), GAE "
                  "(`compute_gae`), update (minibatch forward, backward, optimizer). Model compute = policy forward + update."]
    return "\n".join(lines)
