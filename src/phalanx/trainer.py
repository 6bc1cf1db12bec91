"""The training loop over a run's parts (build.py). PPO's order is on one screen, each line the real call:
`Trainer.collect` (play into the rollout buffer, bootstrap), `Trainer.update` (advantages, value targets, the
minibatch layout, epochs of minibatch steps) and `Trainer.iteration` (both, then the metrics row). `Trainer.train`
runs iterations with logging, progress and checkpoints (saved and restored by run_state.py); `train()` is the
Python entry point (`phalanx.train`).
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from phalanx import checkpoint as ckpt
from phalanx import faults, run_state, runs
from phalanx.algo import GAEParams, compile_step, normalised_values, ppo_update
from phalanx.build import build_run
from phalanx.config import Config, load_file, params_of, resolve
from phalanx.distributed import Dist
from phalanx.envs import registry
from phalanx.errors import ConfigError, EnvContractError, NonFiniteEnvError, NonFiniteLossError, Stopped, StorageError
from phalanx.evaluate import evaluate_policy
from phalanx.logs import Progress, RunLog, grad_clip_hint, summary_row, value_clip_hint
from phalanx.policy import Policy
from phalanx.rollout import StepMode

HISTORY_ROWS = 1_000  # updates kept in memory for RunResult.history
# Keys that may differ when resuming; everything else must match the saved run.
RESUME_MUTABLE = {"total_steps", "progress", "tensorboard", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "eval_episodes", "device", "torch_threads", "run_dir",
                  "wandb", "wandb_project", "wandb_mode"}


@dataclass
class RunResult:
    """What `phalanx.train` returns: where the run lives, its last metrics and the trained policy."""

    run_dir: Path
    metrics: dict[str, float]
    policy: Policy
    config: Config
    history: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    """One training run: the parts `build_run` makes of the config (build.Run says what each is), and PPO's loop
    over them (`collect`, `update`, `iteration`; `train` adds the log, the progress and the checkpoints)."""

    def __init__(self, cfg: Config, run_dir: Path | None = None, resume: bool = False, overwrite: bool = False,
                 step_mode: StepMode | None = None):
        dist = Dist()
        try:
            self.run = build_run(cfg, run_dir, resume, dist, overwrite, step_mode)
        except BaseException:
            dist.close()
            raise
        self.gae = params_of(GAEParams, cfg)  # how advantages are estimated: gamma, gae_lambda, trial_bootstrap
        self.global_step = 0
        self.update_idx = 0
        self.recent_returns: list[float] = []
        # Bounded so a long run's memory stays flat; metrics.jsonl keeps every row.
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_ROWS)
        self.log: RunLog | None = None
        self.checkpoint_every = cfg.checkpoint_every or max(cfg.batch_size, cfg.total_steps // 10)
        self._last_ckpt_step, self._last_ckpt_time = 0, time.monotonic()
        self._last_batch = None  # what a non-finite loss's snapshot saves
        self._hinted = {"value_clip"} if not cfg.clip_vloss else set()  # the hints already printed, once a run

    def compile_update(self, backend: str = "inductor") -> None:
        """The minibatch update step captured whole (`algo.compile_step`); `backend` for tests (aot_eager)."""
        self.run.update_step = compile_step(self.run.update_step, dynamic=False, backend=backend)
        self.run.update_compiled = True

    # -- one PPO iteration, in order ------------------------------------------------------------
    def collect(self) -> dict[str, torch.Tensor]:
        """Play `num_steps` of every env into the buffer (rollout.py: act, fill the other slots, step the envs,
        write the buffer's row, count episodes), then fill in the bootstrap of every step not truncated
        (buffer.py); -> the episode statistics, 0-d tensors."""
        torch.set_num_threads(self.run.threads.collect)
        with self.run.timer.phase("collect"):
            stats = self.run.rollout.collect()
            self.run.buffer.bootstrap(self.run.rollout.value_after())
        return stats

    def update(self) -> dict[str, torch.Tensor]:
        """Advantages by GAE (algo/gae.py), the value targets in the critic's units, the samples laid out for
        minibatches (buffer.py), then epochs of minibatch steps (algo/ppo.py: `update_step` is `minibatch_step`,
        forward, losses, backward, clip and Adam, compiled or a CUDA graph where asked); -> the update's mean
        metrics, 0-d tensors."""
        torch.set_num_threads(self.run.threads.update)
        with self.run.timer.phase("update"):
            if self.run.cfg.anneal_lr:
                self.run.optimizer.set_lr(self.run.cfg.lr * (1.0 - self.update_idx / max(1, self.num_updates)))
            with self.run.timer.phase("gae"):
                adv, ret, trained = self.run.buffer.advantages(self.run.rollout.acts_after(), self.gae)
            values, ret = normalised_values(self.run.buffer["values"], ret, trained, self.run.norms.value)
            # Where every sample trains no mean of any minibatch need test a mask; read where reading is free, and
            # not compiled, where a step without the mask would be a second graph.
            every = not self.run.update_compiled and self.run.rollout.host_branches and self.run.rollout.every_step_active(trained)
            batch = self.run.buffer.ppo_batch(adv, ret, values, None if every else trained, self.run.update_slots)
            if not every and self.run.rollout.host_branches and not self.run.update_compiled:
                batch = batch.trained_rows()
            metrics = ppo_update(self.run.update_step, batch, self.run.update_hp, generator=self.run.gen,
                                 sync_mean=self.run.dist.mean if self.run.dist.enabled else None)
        self._last_batch = batch
        return metrics

    def iteration(self) -> dict[str, Any]:
        """One iteration of PPO: collect a batch, update on it, and summarise both into the update's metrics
        row (the one host read; non-finite values stop the run here). `train` adds the log, the progress and
        the checkpoints around it; `phalanx bench` times exactly this."""
        t0 = time.perf_counter()
        try:
            stats = self.collect()
        except Exception as e:
            cfg = self.run.cfg
            crash = faults.player_crash(e, self.run.run_dir) or faults.env_crash(
                e, self.run.env, self.run.rollout, cfg.env, cfg.num_envs, self.run.run_dir, self.global_step,
                self.update_idx, self.run.dist.world)
            if crash is None:
                raise
            raise crash from None
        if self.run.env.action_masks:
            self._check_masks(stats)
        self.global_step += self.steps_per_update
        if self.run.dist.enabled:  # pooled statistics keep the ranks' normalisers identical
            self.run.dist.pool_stats(self.run.norms.obs)
            self.run.dist.pool_stats(self.run.norms.reward.stats if self.run.norms.reward is not None else None)
        metrics = self.update()
        if self.run.dist.enabled:
            self.run.dist.pool_stats(self.run.norms.value)
        self.update_idx += 1
        return self._summarise(metrics, stats, time.perf_counter() - t0)

    def _check_masks(self, stats: dict[str, torch.Tensor]) -> None:
        """Stop, before the update trains on them, at a rollout step whose record had no mask, or a mask that allowed
        a slot nothing (the update would score those actions under the buffer's all-forbidden zeros): one host read
        an update, for envs that declare action_masks."""
        missing, empty, where = (int(v) for v in torch.stack(
            [stats.pop(k) for k in ("mask_missing_step", "mask_empty_step", "mask_empty_where")]).tolist())
        at = f"at rollout step {{}} of update {self.update_idx + 1}"
        if missing >= 0:
            raise EnvContractError(f"env '{self.run.cfg.env}' declares action_masks but its step returned action_mask=None "
                                   f"{at.format(missing)}; every record must hold the mask (all True where nothing is "
                                   "forbidden); nothing was trained on it")
        if empty >= 0:
            raise EnvContractError(f"env '{self.run.cfg.env}' returned an action mask that allows no action to a slot: first "
                                   f"{at.format(empty)} (env copy {where // self.run.env.num_agents}, slot {where % self.run.env.num_agents}); a mask must "
                                   "leave every slot at least one action (per head); nothing was trained on it")

    @property
    def num_updates(self) -> int:
        return max(1, math.ceil(self.run.cfg.total_steps / self.steps_per_update))

    @property
    def steps_per_update(self) -> int:
        """Environment steps of one update, summed over ranks."""
        return self.run.cfg.batch_size * self.run.dist.world

    def policy(self) -> Policy:
        return Policy(self.run.model, self.run.norms.obs, self.run.cfg, self.run.env.observation_space, self.run.env.action_space,
                      action_masks=self.run.env.action_masks)

    # -- the loop --------------------------------------------------------------------------------
    def train(self, max_updates: int | None = None) -> RunResult:
        """Run until `total_steps` (or `max_updates` more updates, for tests and notebooks)."""
        cfg = self.run.cfg
        if self.run.main:
            self.log = RunLog(self.run.run_dir, cfg.tensorboard, self.global_step if self.run.resume else None,
                              dict(project=cfg.wandb_project, mode=cfg.wandb_mode, config=cfg.to_dict()) if cfg.wandb else None)
        # Whole updates: the run ends at the first update that reaches total_steps, and says so where that is more.
        planned = self.num_updates * self.steps_per_update
        if planned != cfg.total_steps and cfg.progress and self.run.main and self.global_step < cfg.total_steps:
            print(f"total_steps {cfg.total_steps:,} rounds up to whole updates: {self.num_updates:,} of "
                  f"{self.steps_per_update:,} steps, {planned:,} steps", file=sys.stderr, flush=True)
        progress = Progress(planned, enabled=cfg.progress and self.run.main, start=self.global_step, num_agents=self.run.env.num_agents)
        self._last_ckpt_time = started = time.monotonic()
        first_step = self.global_step
        try:
            with runs.stop_signals(announce=self.run.main) as stop:
                last_row = self._train_loop(progress, stop, max_updates)
        except StorageError as e:
            raise StorageError(f"{e}; {faults.kept(self.run.run_dir)}") from None
        except KeyboardInterrupt:  # a second Ctrl-C: the update in flight is abandoned
            raise Stopped(f"interrupted during update {self.update_idx + 1}; {faults.kept(self.run.run_dir)}",
                          signal.SIGINT) from None
        finally:
            progress.close()
            if self.log is not None:
                self.log.close()
        elapsed = time.monotonic() - started
        # The run's own figures: the last row's sps is one update's, its return one update's episodes.
        final = {**last_row, "elapsed_s": elapsed, "run_sps": (self.global_step - first_step) / max(elapsed, 1e-9)}
        if self.recent_returns:
            final["recent_return"] = self.recent_return()
        if self.global_step >= cfg.total_steps and cfg.eval_episodes > 0 and self.run.main:
            ev = evaluate_policy(self.policy(), cfg.env, registry.evaluation_options(cfg.env, cfg.env_options), episodes=cfg.eval_episodes, seed=cfg.seed + 7777, device=self.run.device)
            final.update({f"eval_{k}": v for k, v in ev.items() if isinstance(v, (int, float))})
            ckpt.write_json_atomic(self.run.run_dir / "eval.json", ev)
        # Ranks leave together: one that tore its process group down while rank 0 still evaluated was
        # once aborted by gloo ("terminate called without an active exception") on a loaded machine.
        self.run.dist.barrier()
        return RunResult(self.run.run_dir, final, self.policy(), cfg, list(self.history))

    def _train_loop(self, progress: Progress, stop: runs.StopRequest, max_updates: int | None) -> dict[str, Any]:
        """Updates until `total_steps` (or `max_updates` more), checkpointing every `checkpoint_every` steps and
        `checkpoint_minutes` minutes; a stop signal ends the loop after the current update with a checkpoint
        (Stopped). -> the last update's row."""
        cfg = self.run.cfg
        done_updates, last_row = 0, {}
        while self.global_step < cfg.total_steps and (max_updates is None or done_updates < max_updates):
            row = self.iteration()
            done_updates += 1
            if self.run.main:
                self.log.write(row)
            self.history.append(row)
            last_row = row
            progress.update(self.global_step, row["sps"], self.recent_return())
            if cfg.progress and self.run.main:
                self._hint()
            # Rank 0 decides for every rank (their clocks and signals may differ; a save is collective).
            due = cfg.checkpoint_minutes > 0 and time.monotonic() - self._last_ckpt_time >= 60 * cfg.checkpoint_minutes
            decision = self.run.dist.broadcast_int(2 * (stop.signum or 0) + int(due))
            stop.signum = decision // 2 or None
            if stop.signum is not None:
                break
            if decision % 2 or self.global_step - self._last_ckpt_step >= self.checkpoint_every:
                self.save()
        if self._last_ckpt_step != self.global_step:
            self.save()
        if stop.signum is not None:
            progress.close()
            raise Stopped(f"stopped by {signal.Signals(stop.signum).name} at step {self.global_step:,} of "
                          f"{self.num_updates * self.steps_per_update:,}; checkpoint saved in '{self.run.run_dir}'; "
                          f"resume with `phalanx train --resume {self.run.run_dir}`", stop.signum)
        return last_row

    def _hint(self) -> None:
        """Print each hint the history calls for (logs.py: value and gradient clipping), once a run."""
        cfg = self.run.cfg
        hints = {"value_clip": lambda: value_clip_hint(self.history, self.run.step_hp.value_clip, cfg.norm_value),
                 "grad_clip": lambda: grad_clip_hint(self.history, cfg.max_grad_norm, cfg.norm_value,
                                                     cfg.num_epochs * cfg.num_minibatches)}
        for name, hint in hints.items():
            text = None if name in self._hinted else hint()
            if text is not None:
                self._hinted.add(name)
                print(text, file=sys.stderr, flush=True)

    def recent_return(self) -> float | None:
        """The mean episode return of the last updates that ended episodes (up to 10): what the progress shows
        and the closing line says; None before the first episode ends."""
        return sum(self.recent_returns) / len(self.recent_returns) if self.recent_returns else None

    def _summarise(self, metrics: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], seconds: float) -> dict[str, Any]:
        """The update's metrics row, from one host read of every metric; stops the run on non-finite
        values (from the env or in the loss) with a snapshot of the batch."""
        cfg = self.run.cfg
        means = self.run.dist.mean(torch.stack([v.float() for v in metrics.values()]))
        sums = self.run.dist.sum(torch.stack([v.float() for v in stats.values()]))
        values = dict(zip(list(metrics) + list(stats), torch.cat([means, sums]).tolist()))  # the one host read
        nonfinite = values.pop("nonfinite")
        env_bad, first_bad = values.pop("env_nonfinite"), values.pop("env_first_bad_step")
        for key in ("mask_missing_step", "mask_empty_step", "mask_empty_where"):  # read by _check_masks where masked
            values.pop(key, None)
        row = summary_row(self.global_step, self.update_idx, values, self.run.env.num_agents, self.run.env.success_key)
        if "episode_return" in row:
            self.recent_returns = (self.recent_returns + [row["episode_return"]])[-10:]
        if self.run.league is not None:
            row.update(self.run.league.end_update(self.global_step, self.run.model, self.run.norms.obs))
        if env_bad > 0:
            row["env_nonfinite"] = env_bad
            if cfg.nonfinite_env == "stop":
                step = self.global_step - self.steps_per_update + int(first_bad) * cfg.num_envs * self.run.dist.world
                where = faults.save_nonfinite(self.run.run_dir, self.update_idx, self._last_batch, cfg, row)
                raise NonFiniteEnvError(
                    f"env '{cfg.env}' returned {int(env_bad)} NaN or infinite values (observations, states or "
                    f"rewards), first at rollout step {int(first_bad)} of update {self.update_idx} (about step "
                    f"{step}); batch and config saved to '{where}'; set nonfinite_env=zero to replace them with 0")
        row["lr"] = self.run.optimizer.lr
        row["sps"] = self.steps_per_update / seconds
        row["time"] = time.time()
        if nonfinite > 0 or not all(math.isfinite(v) for v in values.values()):
            where = faults.save_nonfinite(self.run.run_dir, self.update_idx, self._last_batch, cfg, row)
            last = ckpt.list_checkpoints(self.run.run_dir)
            raise NonFiniteLossError(
                f"loss became non-finite at update {self.update_idx} (step {self.global_step}); "
                f"batch and config saved to '{where}'; last good checkpoint: {last[-1] if last else 'none'}"
            )
        return row

    # -- checkpoints (run_state.py) --------------------------------------------------------------
    def save(self) -> Path:
        path = run_state.save(self.run, run_state.Counters(self.global_step, self.update_idx, self.recent_returns))
        self._last_ckpt_step, self._last_ckpt_time = self.global_step, time.monotonic()
        return path

    def restore(self, path: Path) -> None:
        at = run_state.restore(self.run, path)
        self.run.rollout.steps.forget()  # a recorded CUDA graph reads the tensors the restore replaced
        self.global_step, self.update_idx, self.recent_returns = at.global_step, at.update_idx, at.recent_returns
        self._last_ckpt_step, self._last_ckpt_time = self.global_step, time.monotonic()

    def close(self) -> None:
        """Release what the run holds."""
        self.run.env.close()
        if self.run.lock is not None:
            self.run.lock.release()
        self.run.dist.close()


def train(config: Config | str | Path | dict | None = None, *, resume: str | Path | None = None, overwrite: bool = False,
          max_updates: int | None = None, **overrides: Any) -> RunResult:
    """Train a policy. `config` is a Config, a YAML/TOML file or a mapping; keywords override keys.

    `resume=RUN_DIR` continues a stopped run from its last checkpoint; `config` and keywords may change only
    the keys of RESUME_MUTABLE, and total_steps only upwards. A new run refuses a run directory that holds an
    earlier run's files; `overwrite=True` deletes them (the user's own files stay) and starts afresh.
    """
    layers: list[dict[str, Any]] = []
    if isinstance(config, Config):
        layers.append(config.to_dict())
    elif isinstance(config, (str, Path)):
        layers.append(load_file(config))
    elif isinstance(config, dict):
        layers.append(config)
    layers.append(overrides)
    if resume is not None:
        if overwrite:
            raise ConfigError("--overwrite starts a run afresh and --resume continues one: give only one")
        run_dir = Path(resume)
        if ckpt.is_package(run_dir):
            raise ConfigError(f"'{run_dir}' is a package (a policy to play: weights without the optimiser state, counters "
                              "and league that training takes), so it cannot be resumed; train afresh from its config: "
                              f"phalanx train --config {run_dir / 'config.json'}")
        saved = runs.load_run_config(run_dir).to_dict()
        cfg = resolve(saved, *layers)
        for k, v in cfg.to_dict().items():
            if k not in RESUME_MUTABLE and v != saved.get(k, v):
                raise ConfigError(f"config key '{k}' cannot change on resume (run has {saved[k]!r}, got {v!r})")
        if cfg.total_steps < saved["total_steps"]:
            raise ConfigError(f"config key 'total_steps' cannot shrink on resume (run has {saved['total_steps']:,}, got "
                              f"{cfg.total_steps:,}); give a larger one to train longer")
        trainer = Trainer(cfg, run_dir=run_dir, resume=True)
        try:
            trainer.restore(ckpt.latest_checkpoint(run_dir))
            if trainer.global_step >= cfg.total_steps:  # nothing to run: the metrics, events and eval stay as they are
                if trainer.run.main:
                    print(f"run '{run_dir}' is complete: step {trainer.global_step:,} of total_steps {cfg.total_steps:,}; "
                          f"nothing to resume (give a larger --total-steps to train it longer)", file=sys.stderr, flush=True)
                return RunResult(run_dir, {}, trainer.policy(), cfg, [])
            if trainer.run.main:
                runs.truncate_metrics(run_dir, trainer.global_step)
                ckpt.write_json_atomic(run_dir / "config.json", cfg.to_dict())
            return trainer.train(max_updates=max_updates)
        finally:
            trainer.close()
    cfg = resolve(*layers)
    trainer = Trainer(cfg, overwrite=overwrite)
    try:
        if trainer.run.main:
            ckpt.write_json_atomic(trainer.run.run_dir / "config.json", {**cfg.to_dict(), "run_dir": str(trainer.run.run_dir)})
            spec = registry.spec(cfg.env)
            ckpt.write_json_atomic(trainer.run.run_dir / "manifest.json",
                                   {**runs.manifest(trainer.run.device, cfg.seed), "world_size": trainer.run.dist.world,
                                    **({"env_source": spec.source} if spec is not None and spec.source else {})})
        return trainer.train(max_updates=max_updates)
    finally:
        trainer.close()
