"""The training run: collect -> update -> summarise -> log -> checkpoint.

`Trainer` composes the layers below it (the env, the model from models/registry.py, the `Rollout`,
the PPO update of algo/, slot control, the league, checkpoints and logs) and owns the run directory.
`train()` is the Python entry point (`phalanx.train`).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import secrets
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from phalanx import checkpoint as ckpt
from phalanx import runs
from phalanx.algo import Adam, Normalizers, PPOBatch, PPOParams, compile_step, minibatch_step, ppo_update, saved_bytes
from phalanx.config import Config, load_file, resolve
from phalanx.distributed import Dist
from phalanx.envs import make, registry
from phalanx.envs.base import StepRecord, VecEnv, generator_state, set_generator_state
from phalanx.envs.check import check_env
from phalanx.errors import (
    CheckpointError,
    ConfigError,
    EnvCrashError,
    NonFiniteEnvError,
    NonFiniteLossError,
    Stopped,
    StorageError,
    one_line,
    storage_reason,
)
from phalanx.evaluate import evaluate_policy
from phalanx.graphs import GraphedStep, check_graphs
from phalanx.league import LEAGUE_FILE, League, parse_mix
from phalanx.logs import Progress, RunLog, summary_row
from phalanx.models.registry import build_model, check_model, obs_dim_of
from phalanx.policy import Policy
from phalanx.profile import PhaseTimer
from phalanx.rollout import Rollout, frame_index, most_envs, run_bytes
from phalanx.slots import Teammates, opponent_slots, parse_teammates

PROBE_ENVS = 4  # envs of the copy an env is checked and measured on before the full one is built
HISTORY_ROWS = 1_000  # updates kept in memory for RunResult.history
# update_chunks 0 on the CPU: a minibatch piece's activations at most this. drone_swarm's update at 1,024 envs
# (16,384-row minibatches, about 530 MiB) took 11.1 s in 4 pieces against 16.4 s whole; bucket_brigade's
# (256 envs, 17 MiB) was slower cut in 4 (0.40 against 0.32 s) and stays whole.
CPU_PIECE_BYTES = 128 * 2**20
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


def ppo_params(cfg: Config) -> PPOParams:
    return PPOParams(num_epochs=cfg.num_epochs, num_minibatches=cfg.num_minibatches, clip_coef=cfg.clip_coef,
                     vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, max_grad_norm=cfg.max_grad_norm,
                     clip_vloss=cfg.clip_vloss, norm_adv=cfg.norm_adv, target_kl=cfg.target_kl or None,
                     chunks=max(1, cfg.update_chunks))


def ppo_batch(buf: dict[str, torch.Tensor], advantages: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
              trained: torch.Tensor, recurrent: bool, slots: torch.Tensor | None) -> PPOBatch:
    """The rollout laid out for minibatches. Feed-forward: rows are (step, env) pairs with the agent
    axis whole (per-role layers see their slots; `slots` keeps only those the update trains).
    Recurrent: rows are envs, each keeping its whole [A, T] segment so the sequence forward can replay
    it from the memory stored at the rollout's start. `trained` [T, N, A] masks the samples (Rollout.advantages)."""
    mask = trained.float()
    if recurrent:
        seg = lambda x: x.permute(1, 2, 0, *range(3, x.dim()))  # noqa: E731 [T, N, A, ...] -> [N, A, T, ...]
        obs = seg(buf["obs"])
        return PPOBatch(
            obs=obs, critic_obs=buf["states"].transpose(0, 1) if "states" in buf else obs, actions=seg(buf["actions"]),
            logprobs=seg(buf["logprobs"]), advantages=seg(advantages), returns=seg(returns), values=seg(values),
            mask=seg(mask), rows=torch.arange(obs.shape[0], device=obs.device), resets=seg(buf["resets"]),
            env_active=seg(buf["env_active"]),
        )
    flat = lambda x: (x if slots is None else x.index_select(2, slots)).flatten(0, 1)  # noqa: E731
    stored = "frames" in buf  # stacked pixels kept once: the samples index them, minibatches gather them
    obs = flat(frame_index(buf["frames"], buf["stack_restarts"]) if stored else buf["obs"])
    return PPOBatch(
        obs=obs, critic_obs=flat(buf["states"]) if "states" in buf else obs, actions=flat(buf["actions"]),
        logprobs=flat(buf["logprobs"]), advantages=flat(advantages), returns=flat(returns), values=flat(values),
        mask=flat(mask), frames=buf["frames"].flatten(0, 2) if stored else None,
    )


class Trainer:
    """Owns the env, policy, optimizer, statistics and run directory of one training run."""

    def __init__(self, cfg: Config, run_dir: Path | None = None, resume: bool = False):
        self.cfg = cfg
        self.dist = Dist()
        self.env: VecEnv | None = None
        self.lock: runs.RunLock | None = None
        try:
            self._build(cfg, run_dir, resume)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: Config, run_dir: Path | None, resume: bool) -> None:
        """Everything that can refuse the config (env, options, model, slots, buffers) comes before the
        global RNGs are seeded and the run directory is created and locked, so a refused config
        leaves nothing behind."""
        self.device = self.dist.init(runs.resolve_device(cfg.device))
        self.main = self.dist.is_main
        if cfg.progress and self.main:
            why = " (auto: CUDA, then MPS, then CPU)" if cfg.device == "auto" else ""
            print(f"device: {self.device}{why}", file=sys.stderr, flush=True)
        # Every rank must agree on the run directory: rank 0's clock and tag name it.
        stamp, tag = self.dist.broadcast_int(int(time.time())), self.dist.broadcast_int(secrets.randbelow(1 << 24))
        self.run_dir = Path(run_dir or cfg.run_dir or runs.default_run_dir(cfg.env, stamp, tag))
        self.resume = resume
        if self.main:  # before anything is built: a run that could never save is refused in a second
            runs.check_writable_dir(self.run_dir)
        if not resume and ckpt.list_checkpoints(self.run_dir):
            raise ConfigError(f"run directory '{self.run_dir}' already holds a run; use --resume {self.run_dir} or another --run-dir")
        if self.dist.enabled and cfg.opponents:
            raise ConfigError("config key 'opponents' (the self-play league) is not supported with torchrun yet; train it in one process")
        # Each rank's envs and sampling follow their own seed stream.
        self.env_seed = cfg.seed + 1_000_033 * self.dist.rank
        # A copy with a few envs comes first: the cheap part of the env contract (docs/ENVIRONMENTS.md), the
        # model, and the memory the run will hold from their sizes, so that a broken env or an impossible
        # num_envs is refused in seconds with one line (1e8 cartpole envs once took 14 GB before any check).
        self.env = make(cfg.env, num_envs=min(cfg.num_envs, PROBE_ENVS), device=self.device, seed=self.env_seed,
                        **cfg.env_options)
        check_env(self.env, quick=True)
        check_model(cfg, self.env)
        # The initial weights (an orthogonal init's QR) round differently on other thread counts: built on one
        # thread, they are the same on every machine and whatever the threads in effect before the run.
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        with torch.random.fork_rng(devices=[]):  # the model's initial weights follow the seed; the global RNG waits
            torch.manual_seed(cfg.seed)
            self.model = build_model(cfg, self.env).to(self.device)
        size = sum(p.numel() for p in self.model.parameters())
        rows = cfg.batch_size * self.env.num_agents // (cfg.num_minibatches * max(1, cfg.update_chunks))
        self.threads = runs.choose_threads(cfg.torch_threads, self.device, size * cfg.num_envs * self.env.num_agents,
                                           size * rows, self.dist.local_world)
        torch.set_num_threads(self.threads.collect)
        if cfg.progress and self.main:
            print(f"torch threads: {self.threads}", file=sys.stderr, flush=True)
        self._check_memory(self.env.reset(seed=self.env_seed))
        if self.env.num_envs != cfg.num_envs:
            self.env.close()
            self.env = make(cfg.env, num_envs=cfg.num_envs, device=self.device, seed=self.env_seed, **cfg.env_options)
            check_env(self.env, quick=True)  # the rollout's reset(seed) starts the env afresh after it
        self.N, self.A = self.env.num_envs, self.env.num_agents
        slots = parse_teammates(cfg.teammates, self.env)
        if cfg.opponents:
            if cfg.teammates:
                raise ConfigError("config keys 'teammates' and 'opponents' both fill agent slots; set only one")
            parse_mix(cfg.opponents, self.env.scripted_names)
            opponent_slots(self.A, self.device)
        self.dist.broadcast_module(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The learning rate is a device tensor changed in place, and Adam's update reads no host value
        # (phalanx.algo.adam), so the step can be captured whole.
        self.lr = cfg.lr
        self.optimizer = Adam(self.params, lr=torch.tensor(cfg.lr, device=self.device), eps=cfg.adam_eps)
        self.hp = ppo_params(cfg)
        # Autocast's cache of cast weights would outlive a CUDA graph's recording: off under --cuda-graphs.
        self._amp = (partial(torch.autocast, device_type=self.device.type, dtype=torch.bfloat16, cache_enabled=not cfg.cuda_graphs)
                     if cfg.precision == "bf16" else contextlib.nullcontext)
        self.norms = Normalizers(obs_dim_of(self.env), self.N, self.A, norm_obs=cfg.norm_obs, norm_reward=cfg.norm_reward,
                                 norm_value=cfg.norm_value, gamma=cfg.gamma, obs_clip=cfg.obs_clip, device=self.device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(self.env_seed + 1_000_003)
        self.teammates = Teammates(slots, self.env, self.device) if any(slots) else None
        self.learner = torch.tensor([s == "" for s in slots], device=self.device)
        self.league = None
        if cfg.opponents:
            self.learner = ~opponent_slots(self.A, self.device)
            self.league = League(cfg, self.env, self.run_dir, self.policy(), self.gen)
        # A model that treats every slot alike lets the update leave out the slots it does not train
        # (scripted teammates, league opponents), whose loss terms are masked to zero anyway: half of
        # every update in a 1v1 league.
        partial_learner = not bool(self.learner.all())
        self.update_slots = self.learner.nonzero().squeeze(1) if self.model.slot_agnostic and partial_learner else None
        act_value = None if self.model.recurrent else self.model.act_value
        self.update_compiled = False
        self.timer = PhaseTimer(self.device)
        self.rollout = Rollout(cfg, self.env, self.model, self.norms, self.learner, self.gen, act_value, self._amp, self.timer,
                               self.teammates, self.league, seed=self.env_seed)
        if cfg.update_chunks == 0:
            self.hp = replace(self.hp, chunks=self._auto_chunks())
        self._step = minibatch_step(self._evaluate, self.optimizer, self.hp,
                                    sync_grads=self.dist.average_grads if self.dist.enabled else None)
        if cfg.compile:
            # Shapes are fixed for the whole run (num_envs, minibatch sizes), so each compiles once (twice
            # where a remainder makes two minibatch sizes); the update step and, where the env allows,
            # the rollout step are captured whole.
            self.rollout.compile()
            self.compile_update()
        if cfg.cuda_graphs:
            check_graphs(self.device)
            if self.dist.enabled:
                raise ConfigError("config key 'cuda_graphs' is not supported with torchrun yet (gradients are averaged "
                                  "between ranks inside the step); train without it")
            self.rollout.use_cuda_graphs()
            self._step = GraphedStep(self._step, self.device)
        self.global_step = 0
        self.update_idx = 0
        self.recent_returns: list[float] = []
        # Bounded so a long run's memory stays flat; metrics.jsonl keeps every row.
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_ROWS)
        self.log: RunLog | None = None
        self.checkpoint_every = cfg.checkpoint_every or max(cfg.batch_size, cfg.total_steps // 10)
        self._last_ckpt_step = 0
        # Validated: now the run takes its seeds and its directory.
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % (2**32))
        if self.main:
            with runs.writing("run directory", self.run_dir):
                self.run_dir.mkdir(parents=True, exist_ok=True)
                runs.check_run_dir(self.run_dir)
                self.lock = runs.RunLock(self.run_dir)
                self.lock.acquire()
        self.dist.barrier()

    def _check_memory(self, record: StepRecord) -> None:
        """Refuse a run whose envs, buffers and model (`rollout.run_bytes`, from the env copy `self.env` and a
        record of it) would take more than 80% of the device's free memory, saying how many envs would fit;
        announce the rollout buffer's size."""
        cfg = self.cfg
        need = run_bytes(cfg, self.env, record, self.model)
        free = runs.free_memory_bytes(self.device)
        if self.cfg.progress and self.main:
            print(f"rollout buffer: {need['rollout buffer'] / 2**20:,.1f} MiB on {self.device}"
                  + (f" ({free / 2**20:,.0f} MiB free)" if free is not None else ""), file=sys.stderr, flush=True)
        total = sum(need.values())
        # The largest num_envs whose buffers fit (`phalanx bench suite` reports it); None where free memory is unknown.
        self.most_envs = most = None if free is None else most_envs(cfg, self.env, record, self.model, 0.8 * free)
        if free is not None and total > 0.8 * free:
            parts = ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in need.items())
            raise ConfigError(f"the run needs about {total / 2**20:,.0f} MiB ({parts}) but {self.device} has "
                              f"{free / 2**20:,.0f} MiB free; lower num_envs ({cfg.num_envs}: at most {most:,} fit "
                              f"with num_steps {cfg.num_steps}) or num_steps")

    def _minibatch_activations(self) -> tuple[int, int]:
        """(bytes, rows) of one minibatch's activations at its peak: autograd's saved tensors (`saved_bytes`)
        per row, measured on 8 and 16 rows of the (still empty) rollout buffer so that what does not grow with
        the rows drops out, times 2 for the gradients the backward makes of them (drone_swarm at 1,024 envs:
        4 pieces lowered a run's peak by 341 MiB, where 3/4 of twice its 265 MiB of saved tensors is 398), for
        a minibatch's rows."""
        b, shape = self.rollout.buf, (self.cfg.num_steps, self.N, self.A)
        zeros = torch.zeros(shape, device=self.device)
        batch = ppo_batch(b, zeros, zeros, zeros, torch.ones(shape, dtype=torch.bool, device=self.device),
                          self.model.recurrent, self.update_slots)
        rows = -(-len(batch) // min(self.cfg.num_minibatches, len(batch)))
        few = min(8, max(1, len(batch) // 2))
        sizes = [saved_bytes(self._evaluate, batch.index(torch.arange(n, device=self.device)), self.hp, self.params)
                 for n in (few, 2 * few)]
        per_row = max(0, sizes[1] - sizes[0]) / few
        return int(2 * per_row * rows), rows

    def _auto_chunks(self) -> int:
        """update_chunks 0: the fewest pieces of a minibatch whose activations fit in what the device has free
        once the run's buffers are held, and on the CPU pieces of at most `CPU_PIECE_BYTES`; says so where
        memory is why."""
        need, rows = self._minibatch_activations()
        pieces = math.ceil(need / CPU_PIECE_BYTES) if self.device.type == "cpu" else 1
        free = runs.free_memory_bytes(self.device)
        if free is not None and need > 0:
            room = 0.8 * free
            if need / pieces > room:
                fit = math.ceil(need / room) if room > 0 else rows + 1
                if fit > rows:
                    raise ConfigError(f"a minibatch of {rows:,} rows needs about {need / 2**20:,.0f} MiB of activations and "
                                      f"{self.device} has {free / 2**20:,.0f} MiB free after the rollout buffers: not even "
                                      f"one row at a time fits; lower num_envs or num_steps, or raise num_minibatches")
                pieces = fit
                if self.cfg.progress and self.main:
                    print(f"update: a minibatch's activations (about {need / 2**20:,.0f} MiB) do not fit in the "
                          f"{free / 2**20:,.0f} MiB free: each minibatch runs in {pieces} pieces (update_chunks), the "
                          f"same update", file=sys.stderr, flush=True)
        return max(1, min(pieces, rows))

    def compile_update(self, backend: str = "inductor") -> None:
        """The minibatch update step captured whole (`compile_step`); `backend` for tests (aot_eager)."""
        self._step = compile_step(self._step, dynamic=False, backend=backend)
        self.update_compiled = True

    # -- one iteration ---------------------------------------------------------------------------
    def collect(self) -> dict[str, torch.Tensor]:
        torch.set_num_threads(self.threads.collect)
        return self.rollout.collect()

    def _evaluate(self, part: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with self._amp():
            if self.model.recurrent:
                logp, ent, value = self._evaluate_seq(part)
            else:
                logp, ent, value = self.model.evaluate_value(part.obs, part.actions, part.critic_obs)
        return logp.float(), ent.float(), value.float()  # the losses stay in float32

    def _evaluate_seq(self, part: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots = (part.rows.unsqueeze(1) * self.A + torch.arange(self.A, device=self.device)).reshape(-1)
        start = self.rollout.segment_start.select(slots)
        logp, ent, value = self.model.evaluate_seq(part.obs, part.actions, start, part.resets, part.env_active,
                                                     idle_outputs=False)
        if value is None:  # memoryless critic: the global state [B, T, S] -> [B, T, A] -> [B, A, T]
            value = self.model.value(part.critic_obs).transpose(-1, -2) if self.model.centralized else self.model.value(part.critic_obs)
        return logp, ent, value

    def update(self) -> dict[str, torch.Tensor]:
        cfg, b = self.cfg, self.rollout.buf
        torch.set_num_threads(self.threads.update)
        with self.timer.phase("update"):
            adv, ret, trained = self.rollout.advantages()
            values = b["values"]
            if self.norms.value is not None:
                # The clip window is centred on what the critic output at collection: `values` in the units of
                # the statistics it was denormalised with, i.e. before this update folds in the new returns.
                values = self.norms.value.normalize(values)
                self.norms.value.update(ret, trained)
                ret = self.norms.value.normalize(ret)
            batch = ppo_batch(b, adv, ret, values, trained, self.model.recurrent, self.update_slots)
            if not self.update_compiled and self.rollout.host_branches and self.rollout.every_step_active(trained):
                # No mask to test in every mean of every minibatch: a tenth of a small minibatch's ops (#27).
                # Not compiled: a step without the mask would be a second graph, compiled again.
                batch = replace(batch, mask=None)
            if cfg.anneal_lr:
                self.set_lr(cfg.lr * (1.0 - self.update_idx / max(1, self.num_updates)))
            metrics = ppo_update(self._step, batch, self.hp, generator=self.gen,
                                 sync_mean=self.dist.mean if self.dist.enabled else None)
        self._last_batch = batch
        return metrics

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        self.optimizer.param_groups[0]["lr"].fill_(lr)

    @property
    def num_updates(self) -> int:
        return max(1, math.ceil(self.cfg.total_steps / self.steps_per_update))

    @property
    def steps_per_update(self) -> int:
        """Environment steps of one update, summed over ranks."""
        return self.cfg.batch_size * self.dist.world

    def policy(self) -> Policy:
        return Policy(self.model, self.norms.obs, self.cfg, self.env.observation_space, self.env.action_space)

    # -- the loop --------------------------------------------------------------------------------
    def train(self, max_updates: int | None = None) -> RunResult:
        """Run until `total_steps` (or `max_updates` more updates, for tests and notebooks)."""
        cfg = self.cfg
        if self.main:
            self.log = RunLog(self.run_dir, cfg.tensorboard, self.global_step if self.resume else None,
                              dict(project=cfg.wandb_project, mode=cfg.wandb_mode, config=cfg.to_dict()) if cfg.wandb else None)
        # Whole updates: the run ends at the first update that reaches total_steps, and says so where that is more.
        planned = self.num_updates * self.steps_per_update
        if planned != cfg.total_steps and cfg.progress and self.main and self.global_step < cfg.total_steps:
            print(f"total_steps {cfg.total_steps:,} rounds up to whole updates: {self.num_updates:,} of "
                  f"{self.steps_per_update:,} steps, {planned:,} steps", file=sys.stderr, flush=True)
        progress = Progress(planned, enabled=cfg.progress and self.main, start=self.global_step, num_agents=self.A)
        self._last_ckpt_time = started = time.monotonic()
        first_step = self.global_step
        try:
            with runs.stop_signals() as stop:
                last_row = self._train_loop(progress, stop, max_updates)
        except StorageError as e:
            raise StorageError(f"{e}; {self._kept()}") from None
        except KeyboardInterrupt:  # a second Ctrl-C: the update in flight is abandoned
            raise Stopped(f"interrupted during update {self.update_idx + 1}; the last checkpoint (step "
                          f"{self._last_ckpt_step:,}) is in '{self.run_dir}'; resume with "
                          f"`phalanx train --resume {self.run_dir}`", signal.SIGINT) from None
        finally:
            progress.close()
            if self.log is not None:
                self.log.close()
        elapsed = time.monotonic() - started
        # The run's own figures: the last row's sps is one update's, its return one update's episodes.
        final = {**last_row, "elapsed_s": elapsed, "run_sps": (self.global_step - first_step) / max(elapsed, 1e-9)}
        if self.recent_returns:
            final["recent_return"] = self.recent_return()
        if self.global_step >= cfg.total_steps and cfg.eval_episodes > 0 and self.main:
            ev = evaluate_policy(self.policy(), cfg.env, cfg.env_options, episodes=cfg.eval_episodes, seed=cfg.seed + 7777, device=self.device)
            final.update({f"eval_{k}": v for k, v in ev.items() if isinstance(v, (int, float))})
            ckpt.write_json_atomic(self.run_dir / "eval.json", ev)
        # Ranks leave together: one that tore its process group down while rank 0 still evaluated was
        # once aborted by gloo ("terminate called without an active exception") on a loaded machine.
        self.dist.barrier()
        return RunResult(self.run_dir, final, self.policy(), cfg, list(self.history))

    def _train_loop(self, progress: Progress, stop: runs.StopRequest, max_updates: int | None) -> dict[str, Any]:
        """Updates until `total_steps` (or `max_updates` more), checkpointing every `checkpoint_every` steps and
        `checkpoint_minutes` minutes; a stop signal ends the loop after the current update with a checkpoint
        (Stopped). -> the last update's row."""
        cfg = self.cfg
        done_updates, last_row = 0, {}
        while self.global_step < cfg.total_steps and (max_updates is None or done_updates < max_updates):
            t0 = time.perf_counter()
            try:
                stats = self.collect()
            except Exception as e:
                crash = self._env_crash(e)
                if crash is None:
                    raise
                raise crash from None
            self.global_step += self.steps_per_update
            if self.dist.enabled:  # pooled statistics keep the ranks' normalisers identical
                self.dist.pool_stats(self.norms.obs)
                self.dist.pool_stats(self.norms.reward.stats if self.norms.reward is not None else None)
            metrics = self.update()
            if self.dist.enabled:
                self.dist.pool_stats(self.norms.value)
            self.update_idx += 1
            done_updates += 1
            row = self._summarise(metrics, stats, time.perf_counter() - t0)
            if self.main:
                self.log.write(row)
            self.history.append(row)
            last_row = row
            progress.update(self.global_step, row["sps"], self.recent_return())
            # Rank 0 decides for every rank (their clocks and signals may differ; a save is collective).
            due = cfg.checkpoint_minutes > 0 and time.monotonic() - self._last_ckpt_time >= 60 * cfg.checkpoint_minutes
            decision = self.dist.broadcast_int(2 * (stop.signum or 0) + int(due))
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
                          f"{cfg.total_steps:,}; checkpoint saved in '{self.run_dir}'; resume with "
                          f"`phalanx train --resume {self.run_dir}`", stop.signum)
        return last_row

    def recent_return(self) -> float | None:
        """The mean episode return of the last updates that ended episodes (up to 10): what the progress shows
        and the closing line says; None before the first episode ends."""
        return sum(self.recent_returns) / len(self.recent_returns) if self.recent_returns else None

    def _kept(self) -> str:
        """What a run that ends on a fault leaves to resume from, as the end of its one line."""
        last = ckpt.list_checkpoints(self.run_dir)
        if not last:
            return f"no checkpoint was written yet (run directory '{self.run_dir}')"
        return (f"last checkpoint: step {int(last[-1].name.removeprefix('step_')):,}; resume with "
                f"`phalanx train --resume {self.run_dir}`")

    def _env_crash(self, e: Exception) -> EnvCrashError | None:
        """An exception raised inside the env's own code during a rollout, as one line naming the env, the step
        and the exception, with the traceback written to the run directory; None where the env's step is not on
        the traceback (a fault of Phalanx itself keeps its traceback)."""
        frames = [f for f, _ in traceback.walk_tb(e.__traceback__)]
        if not any(f.f_locals.get("self") is self.env for f in frames):
            return None
        at = next((f.f_locals["t"] for f in reversed(frames)
                   if f.f_locals.get("self") is self.rollout and isinstance(f.f_locals.get("t"), int)), None)
        step = self.global_step + (0 if at is None else at * self.cfg.num_envs * self.dist.world)
        where = f"at step {step:,}" + ("" if at is None else f" (rollout step {at} of update {self.update_idx + 1})")
        path = self.run_dir / "env_crash.txt"
        try:
            path.write_text("".join(traceback.format_exception(e)).rstrip("\n") + "\n")
            kept = f"traceback in '{path}'"
        except OSError as fault:
            kept = f"its traceback could not be written to '{path}': {storage_reason(fault)}"
        return EnvCrashError(f"env '{self.cfg.env}' raised {where}: {one_line(e)}; {kept}; {self._kept()}")

    def _summarise(self, metrics: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], seconds: float) -> dict[str, Any]:
        """The update's metrics row, from one host read of every metric; stops the run on non-finite
        values (from the env or in the loss) with a snapshot of the batch."""
        cfg = self.cfg
        means = self.dist.mean(torch.stack([v.float() for v in metrics.values()]))
        sums = self.dist.sum(torch.stack([v.float() for v in stats.values()]))
        values = dict(zip(list(metrics) + list(stats), torch.cat([means, sums]).tolist()))  # the one host read
        nonfinite = values.pop("nonfinite")
        env_bad, first_bad = values.pop("env_nonfinite"), values.pop("env_first_bad_step")
        row = summary_row(self.global_step, self.update_idx, values, self.A, self.env.success_key)
        if "episode_return" in row:
            self.recent_returns = (self.recent_returns + [row["episode_return"]])[-10:]
        if self.league is not None:
            row.update(self.league.end_update(self.global_step, self.model, self.norms.obs))
        if env_bad > 0:
            row["env_nonfinite"] = env_bad
            if cfg.nonfinite_env == "stop":
                step = self.global_step - self.steps_per_update + int(first_bad) * cfg.num_envs * self.dist.world
                where = self._save_nonfinite(row)
                raise NonFiniteEnvError(
                    f"env '{cfg.env}' returned {int(env_bad)} NaN or infinite values (observations, states or "
                    f"rewards), first at rollout step {int(first_bad)} of update {self.update_idx} (about step "
                    f"{step}); batch and config saved to '{where}'; set nonfinite_env=zero to replace them with 0")
        row["lr"] = self.lr
        row["sps"] = self.steps_per_update / seconds
        row["time"] = time.time()
        if nonfinite > 0 or not all(math.isfinite(v) for v in values.values()):
            where = self._save_nonfinite(row)
            last = ckpt.list_checkpoints(self.run_dir)
            raise NonFiniteLossError(
                f"loss became non-finite at update {self.update_idx} (step {self.global_step}); "
                f"batch and config saved to '{where}'; last good checkpoint: {last[-1] if last else 'none'}"
            )
        return row

    def _save_nonfinite(self, metrics: dict[str, Any]) -> Path:
        out = self.run_dir / f"nonfinite_update_{self.update_idx:06d}"
        with runs.writing("the non-finite batch", out):
            out.mkdir(exist_ok=True)
            save_file({k: v.detach().cpu().clone() for k, v in self._last_batch.tensors().items()}, str(out / "batch.safetensors"))
        ckpt.write_json_atomic(out / "config.json", self.cfg.to_dict())
        ckpt.write_json_atomic(out / "metrics.json", metrics)
        return out

    # -- checkpoints -----------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a resume needs besides the weights: optimizer moments, normalisers, the
        rollout (envs, records, episode counters, memory), the league and the RNG states."""
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            for k, v in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"optim.{i}.{k}"] = v
        out.update({f"norms.{k}": v for k, v in self.norms.state_dict().items()})
        out.update(self.rollout.state_tensors())
        if self.league is not None:
            out.update(self.league.state_tensors())
        out["trainer.rng"] = generator_state(self.gen)
        out["torch.rng"] = torch.get_rng_state()
        return out

    def save(self) -> Path:
        py_state = random.getstate()
        np_state = np.random.get_state()
        meta = {
            "env": self.cfg.env,
            "env_options": self.cfg.env_options,
            "global_step": self.global_step,
            "update": self.update_idx,
            "config": self.cfg.to_dict(),
            "model_shapes": {k: list(v.shape) for k, v in self.model.state_dict().items()},
            "lr": [self.lr],
            "recent_returns": self.recent_returns,
            "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
            "numpy_rng": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        }
        if self.league is not None:
            meta["league"] = self.league.state_json(self.global_step)
        meta["world_size"] = self.dist.world
        state = self.dist.gather_state(self.state_tensors())  # every rank takes part
        self._last_ckpt_step, self._last_ckpt_time = self.global_step, time.monotonic()
        if not self.main:
            self.dist.barrier()
            return ckpt.checkpoint_path(self.run_dir, self.global_step)
        path = ckpt.save_checkpoint(
            self.run_dir, self.global_step, self.model.state_dict(), state, meta, self.cfg.keep_checkpoints
        )
        if self.league is not None:
            (self.run_dir / LEAGUE_FILE).parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_json_atomic(self.run_dir / LEAGUE_FILE, meta["league"])
            self.league.prune_files()
        runs.write_metric_csvs(self.run_dir)
        self.dist.barrier()
        return path

    def restore(self, path: Path) -> None:
        model_t, state_t, meta = ckpt.load_checkpoint(path)
        ckpt.check_compatible(path, meta, self.cfg, self.model)
        saved_world = int(meta.get("world_size", 1))
        if saved_world != self.dist.world:
            raise CheckpointError(f"checkpoint '{path}' was written by {saved_world} processes; resume it with "
                                  f"torchrun --nproc-per-node {saved_world} (this run has {self.dist.world})")
        state_t = self.dist.local_state(state_t)
        ckpt.load_weights(self.model, model_t, f"checkpoint '{path}'")
        dev = self.device
        for i, p in enumerate(self.params):
            st = ckpt.section(state_t, f"optim.{i}")
            if st:
                self.optimizer.state[p] = {k: v.to(device=dev, dtype=torch.float32 if k == "step" else v.dtype)
                                           for k, v in st.items()}
        self.set_lr(float(meta["lr"][0]))
        self.norms.load_state_dict(ckpt.section(state_t, "norms", dev))
        self.rollout.load_state(state_t, partial(ckpt.section, state_t))
        if self.league is not None:
            self.league.load(self._league_state(path, meta), state_t)
        set_generator_state(self.gen, state_t["trainer.rng"])
        torch.set_rng_state(state_t["torch.rng"])
        self.global_step = int(meta["global_step"])
        self.update_idx = int(meta["update"])
        self._last_ckpt_step, self._last_ckpt_time = self.global_step, time.monotonic()
        self.recent_returns = list(meta.get("recent_returns", []))
        pr = meta["python_rng"]
        random.setstate((pr[0], tuple(pr[1]), pr[2]))
        nr = meta["numpy_rng"]
        np.random.set_state((nr[0], np.array(nr[1], dtype=np.uint32), nr[2], nr[3], nr[4]))

    def _league_state(self, path: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """The league state saved with the checkpoint, or league.json where it is the same step's
        state plus the games `phalanx eval` rated since."""
        if "league" not in meta:
            raise CheckpointError(f"checkpoint '{path}' has no league state; was the run trained without 'opponents'?")
        live = self.run_dir / LEAGUE_FILE
        try:
            data = json.loads(live.read_text())
            if data.get("step") == meta["global_step"]:
                return data
        except (OSError, json.JSONDecodeError):
            pass
        return meta["league"]

    def close(self) -> None:
        """Release what the run holds; safe on a trainer whose construction failed part-way."""
        if self.env is not None:
            self.env.close()
        if self.lock is not None:
            self.lock.release()
        self.dist.close()


def train(config: Config | str | Path | dict | None = None, *, resume: str | Path | None = None, max_updates: int | None = None, **overrides: Any) -> RunResult:
    """Train a policy. `config` is a Config, a YAML/TOML file or a mapping; keywords override keys.

    `resume=RUN_DIR` continues a stopped run from its last checkpoint; `config` and keywords may change only
    the keys of RESUME_MUTABLE, and total_steps only upwards.
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
        run_dir = Path(resume)
        saved = ckpt.load_run_config(run_dir).to_dict()
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
            if trainer.main:
                runs.truncate_metrics(run_dir, trainer.global_step)
                ckpt.write_json_atomic(run_dir / "config.json", cfg.to_dict())
            return trainer.train(max_updates=max_updates)
        finally:
            trainer.close()
    cfg = resolve(*layers)
    trainer = Trainer(cfg)
    try:
        if trainer.main:
            ckpt.write_json_atomic(trainer.run_dir / "config.json", {**cfg.to_dict(), "run_dir": str(trainer.run_dir)})
            spec = registry.spec(cfg.env)
            ckpt.write_json_atomic(trainer.run_dir / "manifest.json",
                                   {**runs.manifest(trainer.device, cfg.seed), "world_size": trainer.dist.world,
                                    **({"env_source": spec.source} if spec is not None and spec.source else {})})
        return trainer.train(max_updates=max_updates)
    finally:
        trainer.close()
