"""What a run writes as it goes: one metrics row per update (metrics.jsonl, TensorBoard) and progress."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx.errors import ConfigError
from phalanx.runs import writing


class RunLog:
    """metrics.jsonl (one JSON line per update, flushed) and, optionally, TensorBoard events."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None, wandb: dict[str, Any] | None = None):
        self.writer = None
        self.wandb = open_wandb(run_dir, **wandb) if wandb is not None else None
        if tensorboard:
            # Imported on use: it takes about a second, and runs may switch TensorBoard off.
            from torch.utils.tensorboard import SummaryWriter

            # The checkpoint holds the row logged at its own step; later events are from lost updates.
            self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=None if resume_step is None else resume_step + 1)
        self.metrics_path = run_dir / "metrics.jsonl"
        with writing("metrics", self.metrics_path):
            self.metrics_file = open(self.metrics_path, "a")

    def write(self, row: dict[str, Any]) -> None:
        with writing("metrics", self.metrics_path):
            self.metrics_file.write(json.dumps(row) + "\n")
            self.metrics_file.flush()
        if self.writer is not None:
            step = row["step"]
            for k, v in row.items():
                if k in ("step", "update") or v is None:
                    continue
                self.writer.add_scalar(f"{tensorboard_group(k)}/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log({f"{tensorboard_group(k)}/{k}": v for k, v in row.items() if k != "step" and v is not None},
                           step=row["step"])

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a full disk: the unwritten tail is reported where it was written
            self.metrics_file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def open_wandb(run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> Any:
    """A W&B run for this run directory, files under RUN_DIR/wandb; a resumed run continues the same W&B run
    (its id is kept in RUN_DIR/wandb_id)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("config key 'wandb' needs Weights & Biases: pip install 'phalanx[wandb]'") from None
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return wandb.init(project=project, mode=mode, dir=str(run_dir), id=run_id, resume="allow", name=run_dir.name,
                      config=config, settings=wandb.Settings(silent=True))


def tensorboard_group(key: str) -> str:
    if key.startswith("env_reward_"):
        return "reward_terms"
    if key.startswith("league_"):
        return "league"
    return "charts" if key.startswith(("episode", "team", "env_", "success", "sps", "lr")) else "losses"


def summary_row(step: int, update: int, values: dict[str, float], num_agents: int,
                success_key: str | None) -> dict[str, Any]:
    """The metrics row of one update from the update's mean metrics and the rollout's summed
    episode statistics (`values`, read from the device together)."""
    values = dict(values)
    row: dict[str, Any] = {"step": step, "update": update}
    eps = values.pop("episodes")
    ret_sum, len_sum = values.pop("ep_return_sum"), values.pop("ep_length_sum")
    team_eps, team_sum = values.pop("team_episodes"), values.pop("team_return_sum")
    info = {k[5:]: values.pop(k) for k in list(values) if k.startswith("info_")}
    row["episodes"] = int(eps)
    if eps > 0:
        row["episode_return"] = ret_sum / eps
        row["episode_length"] = len_sum / eps
    if num_agents == 1:
        team_eps = eps  # one slot: the env's episodes are the agent's
    if team_eps > 0 and num_agents > 1:
        row["team_return"] = team_sum / team_eps
        for k, v in info.items():
            row[f"env_{k}"] = v / team_eps
    if team_eps > 0 and success_key in info:
        row["success_rate"] = info[success_key] / team_eps
    row.update(values)
    return row


VALUE_CLIP_HINT_UPDATES = 10  # updates over which the value clip's share is averaged, after as many of warm-up
VALUE_CLIP_HINT_SHARE = 0.5


def value_clip_hint(history: Sequence[dict[str, Any]], window: float, norm_value: bool) -> str | None:
    """A hint, once a run has `2 * VALUE_CLIP_HINT_UPDATES` updates, when the value loss clip (half-width `window`)
    held back the value gradient of most samples over the last `VALUE_CLIP_HINT_UPDATES`: returns large beside the
    window, which keeps the critic from following them (LunarLander at the RL Zoo's settings with the clip: 50-78% of
    samples throughout, 95.7 sampled return against 252.0 without; docs/BENCHMARKS.md). A fresh critic's first
    updates clip many samples in healthy runs too (Hopper: 0.4-0.74 over its first 10), hence the warm-up."""
    if len(history) < 2 * VALUE_CLIP_HINT_UPDATES:
        return None
    recent = [row["value_clip_fraction"] for row in list(history)[-VALUE_CLIP_HINT_UPDATES:]]
    share = sum(recent) / len(recent)
    if share <= VALUE_CLIP_HINT_SHARE:
        return None
    remedy = "--clip-vloss false" if norm_value else "--clip-vloss false, or --norm-value true"
    return (f"hint: the value loss clip held back {share:.0%} of the samples' value gradient over the last "
            f"{VALUE_CLIP_HINT_UPDATES} updates (value_clip_fraction): returns move by more than its window of "
            f"{window:g} an update, so the critic lags them; try {remedy} (docs/GUIDE.md)")


GRAD_CLIP_HINT_UPDATES = 20  # updates over which the clip's shrink and the policy's move are judged, after as many
GRAD_CLIP_HINT_SHRINK = 10.0  # the gradient norm over max_grad_norm at or above which an update is cut to a tenth
GRAD_CLIP_HINT_KL = 1e-4  # a median approx KL below this: the policy stands still


def grad_clip_hint(history: Sequence[dict[str, Any]], max_grad_norm: float, norm_value: bool,
                   minibatch_steps: int) -> str | None:
    """A hint, once a run has `2 * GRAD_CLIP_HINT_UPDATES` updates, when the gradient norm clip shrinks every update
    many times over and the policy stands still: the value loss, in units of the returns, owns the shared norm
    (simple_spread at the schema's defaults: grad norm 25 against 0.5, approx KL 1e-6 to 1e-8, issue 51). Both
    medians must hold: a hard clip that still moves the policy, or a still policy whose gradient is small (the end
    of an annealed run), say nothing; nor does an update of one minibatch step (`minibatch_steps`, epochs times
    minibatches), whose approx KL is read before its only step."""
    if len(history) < 2 * GRAD_CLIP_HINT_UPDATES or minibatch_steps < 2:
        return None
    recent = list(history)[-GRAD_CLIP_HINT_UPDATES:]
    norm = statistics.median(row["grad_norm"] for row in recent)
    kl = statistics.median(row["approx_kl"] for row in recent)
    if norm < GRAD_CLIP_HINT_SHRINK * max_grad_norm or kl >= GRAD_CLIP_HINT_KL:
        return None
    remedy = ("a larger --max-grad-norm" if norm_value
              else "--norm-value true (the value loss in running-normalised units), or --norm-reward true")
    return (f"hint: the gradient clip cut every update about {norm / max_grad_norm:.0f}x over the last "
            f"{GRAD_CLIP_HINT_UPDATES} updates (grad_norm {norm:.3g} against max_grad_norm {max_grad_norm:g}) and the "
            f"policy barely moved (approx_kl {kl:.1e}): a value loss in units of large returns owns the clipped "
            f"gradient; try {remedy} (docs/GUIDE.md)")


def return_label(num_agents: int) -> str:
    """What a training return is: an agent slot's episode return, which with several slots is not the team's."""
    return "return" if num_agents == 1 else "return per agent"


class Progress:
    """A live bar (rich) on a terminal; a line every 10% of the run otherwise. `total` is the steps the run
    will take (whole updates), `ret` the mean return of the last updates' episodes (None: none ended yet)."""

    def __init__(self, total: int, enabled: bool, start: int = 0, num_agents: int = 1):
        self.total, self.enabled = total, enabled
        self.label = return_label(num_agents)
        self._bar = None
        self._next_line = 0.1
        if not enabled:
            return
        if sys.stderr.isatty():
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} steps"),
                TextColumn("{task.fields[sps]:>9,.0f} steps/s"), TextColumn("{task.fields[ret]}"),
                TimeRemainingColumn(), transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, sps=0.0, ret=self._ret(None))
            self._bar.start()

    def _ret(self, ret: float | None) -> str:
        return f"{self.label} " + ("(no episode ended yet)" if ret is None else f"{ret:.2f}")

    def update(self, step: int, sps: float, ret: float | None) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, sps=sps, ret=self._ret(ret))
        elif step / self.total >= self._next_line or step >= self.total:
            print(f"step {step:>10,}/{self.total:,}  {sps:>9,.0f} steps/s  {self._ret(ret)}", file=sys.stderr, flush=True)
            while self._next_line <= step / self.total:
                self._next_line += 0.1

    def close(self) -> None:
        """Stop the bar (again: a no-op; a stopped run closes it before its last line)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
