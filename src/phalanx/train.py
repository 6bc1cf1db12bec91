"""The training loop: collect a rollout on the device, update, log, checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from phalanx import checkpoint as ckpt
from phalanx import runs
from phalanx.algo import PPOBatch, RewardScaler, RunningMeanStd, compute_gae, ppo_update
from phalanx.algo.ppo import METRIC_NAMES
from phalanx.config import Config, resolve
from phalanx.distributed import Dist
from phalanx.envs import make
from phalanx.envs.base import VecEnv, generator_state, set_generator_state
from phalanx.envs.spaces import Box
from phalanx.errors import CheckpointError, ConfigError, NonFiniteEnvError, NonFiniteLossError
from phalanx.models import MLPActorCritic

HISTORY_ROWS = 1_000  # updates kept in memory for RunResult.history
# Keys that may differ when resuming; everything else must match the saved run.
RESUME_MUTABLE = {"total_steps", "progress", "tensorboard", "checkpoint_every", "keep_checkpoints", "eval_episodes", "device", "torch_threads", "run_dir"}


def obs_dim_of(env: VecEnv) -> int:
    return int(math.prod(env.observation_space.shape))


def state_dim_of(env: VecEnv) -> int | None:
    return int(math.prod(env.state_space.shape)) if env.state_space is not None else None


def is_image_env(env: VecEnv) -> bool:
    return len(env.observation_space.shape) == 3


def build_model(cfg: Config, env: VecEnv) -> nn.Module:
    if cfg.critic == "mappo" and env.state_space is None:
        raise ConfigError(f"config key 'critic' is 'mappo' but env '{cfg.env}' has no global state; use ippo")
    roles = env.roles.detach().cpu() if cfg.param_sharing == "per_role" else None
    if cfg.model == "cnn" or (is_image_env(env) and cfg.model in ("lstm", "transformer")):
        return _build_cnn(cfg, env, roles)
    if cfg.model == "role_attention":
        from phalanx.models.role_attention import RoleAttentionActorCritic

        if roles is not None:
            raise ConfigError("config key 'param_sharing' cannot be per_role with model=role_attention (roles enter as "
                              "embeddings); use shared or shared_id")
        if cfg.relay_mass > 1.0:
            raise ConfigError(f"config key 'relay_mass' must be in [0, 1], got {cfg.relay_mass}")
        relays = tuple(i for i, n in enumerate(env.role_names) if n == "relay")
        return RoleAttentionActorCritic(
            obs_dim_of(env), env.action_space, env.roles.detach().cpu(), len(env.role_names), relay_roles=relays,
            width=cfg.tf_width, heads=cfg.tf_heads, hidden_sizes=tuple(cfg.hidden_sizes), activation=cfg.activation,
            agent_id=cfg.param_sharing == "shared_id", state_dim=state_dim_of(env) if cfg.critic == "mappo" else None,
            init_log_std=cfg.init_log_std, masses=(1.0 - cfg.relay_mass, cfg.relay_mass), relay_floor=cfg.relay_floor,
            temperature=cfg.attn_temperature,
        )
    if cfg.model != "mlp":
        from phalanx.models.memory import LSTMActorCritic, TransformerActorCritic

        if roles is not None:
            raise ConfigError(f"config key 'param_sharing' cannot be per_role with model={cfg.model}; use shared or shared_id")
        common = dict(num_agents=env.num_agents, agent_id=cfg.param_sharing == "shared_id",
                      state_dim=state_dim_of(env) if cfg.critic == "mappo" else None, init_log_std=cfg.init_log_std,
                      critic_hidden=tuple(cfg.hidden_sizes))
        if cfg.model == "lstm":
            return LSTMActorCritic(obs_dim_of(env), env.action_space, hidden=cfg.lstm_hidden, activation=cfg.activation, **common)
        if cfg.model == "strategy":
            from phalanx.models.strategy import StrategyActorCritic

            # Each layer attends `horizon` steps back, so the layers together see strategy_history steps.
            horizon = -(-cfg.strategy_history // cfg.tf_layers)
            return StrategyActorCritic(obs_dim_of(env), env.action_space, hidden=cfg.lstm_hidden, width=cfg.tf_width,
                                       layers=cfg.tf_layers, heads=cfg.tf_heads, history=horizon,
                                       activation=cfg.activation, **common)
        return TransformerActorCritic(obs_dim_of(env), env.action_space, width=cfg.tf_width, layers=cfg.tf_layers,
                                      heads=cfg.tf_heads, horizon=cfg.tf_horizon, **common)
    return MLPActorCritic(
        obs_dim_of(env), env.action_space, tuple(cfg.hidden_sizes), cfg.activation,
        num_agents=env.num_agents, agent_id=cfg.param_sharing == "shared_id", roles=roles,
        state_dim=state_dim_of(env) if cfg.critic == "mappo" else None, init_log_std=cfg.init_log_std,
    )


def _build_cnn(cfg: Config, env: VecEnv, roles: torch.Tensor | None) -> nn.Module:
    from phalanx.models.cnn import CNNActorCritic, CNNMemoryActorCritic

    if not is_image_env(env):
        raise ConfigError(f"config key 'model' is cnn but env '{cfg.env}' has flat observations "
                          f"{tuple(env.observation_space.shape)}; allowed for it: mlp, lstm, transformer")
    if cfg.critic == "mappo" or roles is not None:
        raise ConfigError("image policies use a per-agent critic and shared parameters: set critic ippo, param_sharing shared or shared_id")
    if cfg.norm_obs:
        raise ConfigError("config key 'norm_obs' must be false for image observations (the CNN scales pixels itself)")
    shape = tuple(env.observation_space.shape)
    high = float(env.observation_space.high_tensor("cpu").max())
    common = dict(num_agents=env.num_agents, agent_id=cfg.param_sharing == "shared_id", init_log_std=cfg.init_log_std)
    if cfg.model == "cnn":
        if len(cfg.cnn_channels) != 3:
            raise ConfigError(f"config key 'cnn_channels' needs 3 widths (one per conv layer), got {cfg.cnn_channels}")
        return CNNActorCritic(shape, env.action_space, channels=tuple(cfg.cnn_channels), out_dim=cfg.cnn_dense,
                              hidden_sizes=(), max_value=high, **common)
    core = dict(hidden=cfg.lstm_hidden) if cfg.model == "lstm" else dict(width=cfg.tf_width, layers=cfg.tf_layers,
                                                                           heads=cfg.tf_heads, horizon=cfg.tf_horizon)
    return CNNMemoryActorCritic(shape, env.action_space, core=cfg.model, channels=tuple(cfg.cnn_channels),
                                out_dim=cfg.cnn_dense, max_value=high,
                                critic_hidden=tuple(cfg.hidden_sizes), **core, **common)


def parse_teammates(teammates: str, env: VecEnv) -> list[str]:
    """Per-slot controller names: '' for learner slots, else a scripted name or run:DIR."""
    names = [t.strip() for t in teammates.split(",") if t.strip()]
    if len(names) >= env.num_agents:
        raise ConfigError(
            f"config key 'teammates' names {len(names)} slots but env '{env.name}' has {env.num_agents}; leave at least one learner"
        )
    for n in names:
        if not n.startswith("run:") and n not in env.scripted_names:
            allowed = ", ".join(env.scripted_names) or "none"
            raise ConfigError(f"config key 'teammates' has unknown policy '{n}'; allowed: {allowed}, or run:RUN_DIR")
    return [""] * (env.num_agents - len(names)) + names


class Teammates:
    """Fills the non-learner slots' actions from scripted policies or frozen trained policies."""

    def __init__(self, slots: list[str], env: VecEnv, device: torch.device):
        self.env = env
        self.learner = torch.tensor([s == "" for s in slots], device=device)
        self.groups: list[tuple[str, torch.Tensor, Any]] = []
        for name in dict.fromkeys(s for s in slots if s):
            mask = torch.tensor([s == name for s in slots], device=device)
            frozen = None
            if name.startswith("run:"):
                from phalanx.policy import load

                frozen = load(name[4:], device=str(device))
            self.groups.append((name, mask, frozen))

    def fill(self, actions: torch.Tensor, record: Any, generator: torch.Generator) -> torch.Tensor:
        for name, mask, frozen in self.groups:
            other = frozen.act(record.obs, greedy=False, generator=generator) if frozen else self.env.scripted_actions(name, record, generator)
            m = mask.reshape(1, -1, *([1] * (actions.dim() - 2)))
            actions = torch.where(m, other.to(actions.dtype), actions)
        return actions


class Normalizers(nn.Module):
    """Observation, reward and value statistics: all saved with checkpoints, obs stats used by eval."""

    def __init__(self, cfg: Config, obs_dim: int, num_envs: int, num_agents: int, device: torch.device):
        super().__init__()
        self.obs = RunningMeanStd((obs_dim,), device=device) if cfg.norm_obs else None
        self.reward = RewardScaler((num_envs, num_agents), cfg.gamma, device=device) if cfg.norm_reward else None
        self.value = RunningMeanStd((), device=device) if cfg.norm_value else None
        self.obs_clip = cfg.obs_clip


@dataclass
class RunResult:
    """What `phalanx.train` returns: where the run lives, its last metrics and the trained policy."""

    run_dir: Path
    metrics: dict[str, float]
    policy: Any
    config: Config
    history: list[dict[str, Any]] = field(default_factory=list)


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
        """Everything that can refuse the config (env, options, model, buffers) comes before the run
        directory is created and locked, so a refused config leaves nothing behind."""
        self.device = self.dist.init(runs.resolve_device(cfg.device))
        self.main = self.dist.is_main
        if cfg.progress and self.main:
            why = " (auto: CUDA, then MPS, then CPU)" if cfg.device == "auto" else ""
            print(f"device: {self.device}{why}", file=sys.stderr, flush=True)
        if cfg.torch_threads > 0:
            torch.set_num_threads(cfg.torch_threads)
        # Every rank must agree on the run directory: rank 0's clock names it.
        stamp = self.dist.broadcast_int(int(time.time()))
        self.run_dir = Path(run_dir or cfg.run_dir or runs.default_run_dir(cfg.env, stamp))
        self.resume = resume
        if self.dist.enabled and cfg.opponents:
            raise ConfigError("config key 'opponents' (the self-play league) is not supported with torchrun yet; train it in one process")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % (2**32))
        # Each rank's envs and sampling follow their own seed stream.
        self.env_seed = cfg.seed + 1_000_033 * self.dist.rank
        self.env = make(cfg.env, num_envs=cfg.num_envs, device=self.device, seed=self.env_seed, **cfg.env_options)
        self.N, self.A = self.env.num_envs, self.env.num_agents
        self.model = build_model(cfg, self.env).to(self.device)
        self.dist.broadcast_module(self.model)
        self.image = getattr(self.model, "obs_is_image", False)
        self.teammates = Teammates(parse_teammates(cfg.teammates, self.env), self.env, self.device)
        self.learner = self.teammates.learner
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # One fused kernel per step on CUDA; the multi-tensor (foreach) path elsewhere.
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr, eps=cfg.adam_eps, fused=fused, foreach=not fused)
        self._amp = (partial(torch.autocast, device_type=self.device.type, dtype=torch.bfloat16)
                     if cfg.precision == "bf16" else contextlib.nullcontext)
        self.norms = Normalizers(cfg, obs_dim_of(self.env), self.N, self.A, self.device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(self.env_seed + 1_000_003)
        self.league = None
        if cfg.opponents:
            from phalanx.league import League, opponent_slots

            if cfg.teammates:
                raise ConfigError("config keys 'teammates' and 'opponents' both fill agent slots; set only one")
            self.learner = ~opponent_slots(self.A, self.device)
            self.league = League(cfg, self.env, self.run_dir, self.policy(), self.gen)
        # A model with one parameter set, no slot id and a per-agent critic treats every slot alike, so the
        # update can leave out the slots it does not train (scripted teammates, league opponents), whose
        # loss terms are masked to zero anyway: half of every update in a 1v1 league.
        agnostic = (type(self.model) is MLPActorCritic and cfg.param_sharing == "shared" and not self.model.centralized)
        self.update_slots = self.learner.nonzero().squeeze(1) if agnostic and not bool(self.learner.all()) else None
        self.global_step = 0
        self.update_idx = 0
        self.recent_returns: list[float] = []
        # Bounded so a long run's memory stays flat; metrics.jsonl keeps every row.
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_ROWS)
        self._alloc_buffers()
        self.record = self.env.reset(seed=self.env_seed)
        # The observation statistics count the reset observations here and every later one once, as it
        # arrives in `collect` (a rollout starts from the observation the previous one already counted).
        self._obs_in(self.record.obs, update=True, mask=self.record.active & self.learner)
        self.ep_return = torch.zeros(self.N, self.A, device=self.device)
        self.ep_length = torch.zeros(self.N, self.A, device=self.device)
        self.team_return = torch.zeros(self.N, device=self.device)
        self.recurrent = getattr(self.model, "recurrent", False)
        if self.recurrent:
            self.memory = self.model.initial_state(self.N * self.A, self.device)
            self.prev_done = torch.zeros(self.N, self.A, dtype=torch.bool, device=self.device)
        self._act, self._evaluate_fn = self.model.act if not self.recurrent else None, self._evaluate
        if cfg.compile:
            if self.recurrent:
                raise ConfigError("config key 'compile' supports feed-forward models (mlp, cnn, role_attention) for now")
            # Shapes are fixed for the whole run (num_envs, minibatch size), so each compiles once.
            self._act = torch.compile(self.model.act, dynamic=False)
            self._evaluate_fn = torch.compile(self._evaluate, dynamic=False)
        self.final_values_whole_batch = self.device.type != "cpu"
        self.writer = None
        self.checkpoint_every = cfg.checkpoint_every or max(cfg.batch_size, cfg.total_steps // 10)
        self._last_ckpt_step = 0
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            runs.check_run_dir(self.run_dir)
            self.lock = runs.RunLock(self.run_dir)
            self.lock.acquire()
        self.dist.barrier()

    # -- buffers ---------------------------------------------------------------------------------
    def buffer_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every rollout buffer; image observations stay uint8."""
        T, N, A = self.cfg.num_steps, self.N, self.A
        space = self.env.action_space
        act_dtype = torch.float32 if isinstance(space, Box) else torch.long
        obs = ((T, N, A, *self.env.observation_space.shape), torch.uint8) if self.image else ((T, N, A, obs_dim_of(self.env)), torch.float32)
        specs = {"obs": obs, "actions": ((T, N, A, *space.shape), act_dtype)}
        for k in ("logprobs", "values", "next_values", "rewards"):
            specs[k] = ((T, N, A), torch.float32)
        for k in ("terminated", "truncated", "active", "trial_end"):
            specs[k] = ((T, N, A), torch.bool)
        if getattr(self.model, "recurrent", False):
            specs["resets"] = specs["env_active"] = ((T, N, A), torch.bool)
        if self.model.centralized:
            specs["states"] = ((T, N, state_dim_of(self.env)), torch.float32)
        return specs

    def buffer_bytes(self) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in self.buffer_specs().values())

    def _alloc_buffers(self) -> None:
        need = self.buffer_bytes()
        free = runs.free_memory_bytes(self.device)
        if self.cfg.progress:
            print(f"rollout buffer: {need / 2**20:,.1f} MiB on {self.device}"
                  + (f" ({free / 2**20:,.0f} MiB free)" if free is not None else ""), file=sys.stderr, flush=True)
        if free is not None and need > 0.8 * free:
            raise ConfigError(
                f"the rollout buffer needs {need / 2**20:,.0f} MiB but {self.device} has {free / 2**20:,.0f} MiB free; "
                f"lower num_envs ({self.cfg.num_envs}) or num_steps ({self.cfg.num_steps})"
            )
        self.buf = {k: torch.zeros(shape, dtype=dt, device=self.device) for k, (shape, dt) in self.buffer_specs().items()}

    def _obs_in(self, obs: torch.Tensor, update: bool = False, mask: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
        if self.image:
            return obs  # uint8 pixels; the CNN scales them
        x = obs.reshape(rows or self.N, self.A, -1).float()
        if self.norms.obs is None:
            return x
        if update:
            self.norms.obs.update(x, mask)
        return self.norms.obs.normalize(x, self.cfg.obs_clip)

    def _value(self, obs_n: torch.Tensor, state: torch.Tensor | None, envs: torch.Tensor | None = None) -> torch.Tensor:
        """V of observations of all envs, or of the envs `envs` (a long index) only."""
        with self._amp():
            if getattr(self.model, "memory_critic", False):
                # V from the memory as it stands (e.g. V(final_obs) before the next step's reset); writes nothing.
                memory = self.memory
                if envs is not None:
                    memory = memory.select((envs.unsqueeze(1) * self.A + torch.arange(self.A, device=envs.device)).reshape(-1))
                v = self.model.value_step(obs_n, memory)
            else:
                v = self.model.value(state.reshape(state.shape[0], -1).float() if self.model.centralized else obs_n)
        return self._denorm(v.float())

    def _denorm(self, v: torch.Tensor) -> torch.Tensor:
        return self.norms.value.denormalize(v) if self.norms.value is not None else v

    # -- rollout ---------------------------------------------------------------------------------
    @torch.no_grad()
    def collect(self) -> dict[str, torch.Tensor]:
        """One rollout of `num_steps` on the device; returns episode statistics as tensors.

        Agent episodes are counted per learner slot; team episodes (the env's episode, all slots'
        rewards summed) where every slot is done or was already inactive.
        """
        b, rec = self.buf, self.record
        zero = lambda: torch.zeros((), device=self.device)  # noqa: E731
        stats = {"ep_return_sum": zero(), "ep_length_sum": zero(), "episodes": zero(), "team_return_sum": zero(), "team_episodes": zero(),
                 "env_nonfinite": zero(), "env_first_bad_step": torch.full((), -1.0, device=self.device)}
        head, learner = self.model.head, self.learner
        obs_n = self._obs_in(rec.obs)
        memory_critic = getattr(self.model, "memory_critic", False)
        if self.recurrent:
            self.segment_start = self.memory.clone()
        value = None if memory_critic else self._value(obs_n, rec.state)
        for t in range(self.cfg.num_steps):
            if self.recurrent:
                b["resets"][t] = self.prev_done
                b["env_active"][t] = rec.active
                with self._amp():
                    action, logp, v_mem, self.memory = self.model.act_step(obs_n, self.memory, self.prev_done, rec.active, self.gen)
                logp, v_mem = logp.float(), v_mem.float() if v_mem is not None else None
                if memory_critic:
                    value = self._denorm(v_mem)
            else:
                with self._amp():
                    action, logp = self._act(obs_n, self.gen)
                logp = logp.float()
            if self.teammates.groups:
                action = self.teammates.fill(action, rec, self.gen)
            if self.league is not None:
                action = self.league.fill(action, rec)
            acting = rec.active & learner
            b["obs"][t] = obs_n
            if "states" in b:
                b["states"][t] = rec.state.reshape(self.N, -1)
            b["actions"][t] = action
            b["logprobs"][t] = logp
            b["values"][t] = value
            b["active"][t] = acting
            prev_active = rec.active
            rec = self._checked(self.env.step(head.to_env(action)), t, stats)
            next_n = self._obs_in(rec.obs, update=True, mask=rec.active & learner)
            reward = rec.reward
            done = rec.terminated | rec.truncated
            if memory_critic:
                # Until the last step, what follows is valued by the next step's act_step (same memory, no
                # reset where the episode goes on): those entries are filled in after the loop.
                ahead = self._value(next_n, None) if t == self.cfg.num_steps - 1 else torch.zeros_like(reward)
                b["next_values"][t] = self._final_values(rec, ahead)
            else:
                value = self._value(next_n, rec.state)
                b["next_values"][t] = self._final_values(rec, value)
            if self.recurrent:
                self.prev_done = done
            self.ep_return += reward
            self.ep_length += prev_active.float()
            agent_done = done & acting
            stats["ep_return_sum"] += (self.ep_return * agent_done).sum()
            stats["ep_length_sum"] += (self.ep_length * agent_done).sum()
            stats["episodes"] += agent_done.sum()
            if self.A > 1:
                self.team_return += (reward * prev_active).sum(-1)
                env_done = (done | ~prev_active).all(-1)
                stats["team_return_sum"] += (self.team_return * env_done).sum()
                stats["team_episodes"] += env_done.sum()
                self.team_return.masked_fill_(env_done, 0.0)
            else:
                env_done = done.squeeze(-1)
            if self.league is not None:
                sides = torch.stack([(self.ep_return * learner).sum(-1), (self.ep_return * ~learner).sum(-1)], -1)
                self.league.after_step(rec, env_done, sides)
            for k, v in rec.info.items():
                if k in ("episode_return", "episode_length") and k != self.env.success_key:
                    continue  # tracked above, per agent slot
                key = f"info_{k}"
                if key not in stats:
                    stats[key] = zero()
                stats[key] += (self._learner_mean(v) * env_done).sum()
            self.ep_return.masked_fill_(done, 0.0)
            self.ep_length.masked_fill_(done, 0.0)
            if self.cfg.team_reward > 0:
                w = self.cfg.team_reward
                team = (reward * prev_active).sum(-1, keepdim=True) / prev_active.sum(-1, keepdim=True).clamp_min(1)
                reward = (1 - w) * reward + w * team
            if self.norms.reward is not None:
                reward = self.norms.reward(reward, done, acting)
            b["rewards"][t] = reward
            b["terminated"][t] = rec.terminated
            b["truncated"][t] = rec.truncated
            b["trial_end"][t] = rec.trial_end
            obs_n = next_n
        if memory_critic:
            nv = b["next_values"]
            nv[:-1] = torch.where(b["truncated"][:-1], nv[:-1], b["values"][1:])
        self.record = rec
        return stats

    def _checked(self, rec: Any, t: int, stats: dict[str, torch.Tensor]):
        """The env boundary: count NaN / infinite observations, states and rewards on the device
        (read with the update's metrics); `nonfinite_env: zero` also replaces them with 0."""
        fields = [f for f in ("obs", "final_obs", "reward", "state", "final_state") if getattr(rec, f) is not None]
        if self.image:  # uint8 pixels cannot be NaN
            fields = [f for f in fields if f not in ("obs", "final_obs")]
        bad = sum((~torch.isfinite(getattr(rec, f))).sum() for f in fields)
        stats["env_nonfinite"] += bad
        stats["env_first_bad_step"] = torch.where((stats["env_first_bad_step"] < 0) & (bad > 0), t,
                                                  stats["env_first_bad_step"])
        if self.cfg.nonfinite_env == "zero":
            for f in fields:
                setattr(rec, f, torch.nan_to_num(getattr(rec, f), nan=0.0, posinf=0.0, neginf=0.0))
        return rec

    def _learner_mean(self, v: torch.Tensor) -> torch.Tensor:
        """An info value per env [N]: per-slot values [N, A] averaged over the learner's slots."""
        v = v.float().reshape(self.N, -1)
        if v.shape[1] == self.A and self.A > 1:
            return (v * self.learner).sum(-1) / self.learner.sum()
        return v.mean(-1)

    def _final_values(self, rec, next_value: torch.Tensor) -> torch.Tensor:
        """The bootstrap of this step (DESIGN.md section 2): V(final_obs) where the slot was truncated,
        else `next_value`, V of the observation that follows, also across a trial end (terminated steps
        ignore it). Only the truncated envs go through the critic (`final_values_whole_batch` False:
        on CPU, reading which they are costs nothing) or the whole batch does (accelerators: no host
        sync); both give the same values."""
        trunc, state = rec.truncated, rec.final_state
        if not self.final_values_whole_batch:
            envs = trunc.any(-1).nonzero().squeeze(1)
            if envs.numel() == 0:
                return next_value
            final = self._value(self._obs_in(rec.final_obs[envs], rows=len(envs)), state[envs] if state is not None else None, envs)
            out = next_value.clone()
            out[envs] = torch.where(trunc[envs], final, next_value[envs])
            return out
        return torch.where(trunc, self._value(self._obs_in(rec.final_obs), state), next_value)

    # -- update ----------------------------------------------------------------------------------
    def _evaluate(self, part: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with self._amp():
            logp, ent, value = self._evaluate_model(part)
        return logp.float(), ent.float(), value.float()  # the losses stay in float32

    def _evaluate_model(self, part: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.recurrent:
            if hasattr(self.model, "evaluate_value"):  # one trunk pass for both heads (CNN)
                return self.model.evaluate_value(part.obs, part.actions)
            logp, ent = self.model.evaluate(part.obs, part.actions)
            return logp, ent, self.model.value(part.critic_obs)
        slots = (part.rows.unsqueeze(1) * self.A + torch.arange(self.A, device=self.device)).reshape(-1)
        start = self.segment_start.select(slots)
        logp, ent, value = self.model.evaluate_seq(part.obs, part.actions, start, part.resets, part.env_active,
                                                     idle_outputs=False)
        if value is None:  # memoryless critic: the global state [B, T, S] -> [B, T, A] -> [B, A, T]
            value = self.model.value(part.critic_obs).transpose(-1, -2) if self.model.centralized else self.model.value(part.critic_obs)
        return logp, ent, value

    def update(self) -> dict[str, torch.Tensor]:
        cfg, b = self.cfg, self.buf
        adv, ret = compute_gae(
            b["rewards"], b["values"], b["next_values"], b["terminated"], b["truncated"],
            cfg.gamma, cfg.gae_lambda, active=b["active"], trial_end=b["trial_end"], trial_bootstrap=cfg.trial_bootstrap,
        )
        values = b["values"]
        mask = b["active"].float()
        if self.norms.value is not None:
            # The clip window is centred on what the critic output at collection: `values` in the units of
            # the statistics it was denormalised with, i.e. before this update folds in the new returns.
            values = self.norms.value.normalize(values)
            self.norms.value.update(ret, b["active"])
            ret = self.norms.value.normalize(ret)
        if self.recurrent:
            # Rows are envs; each keeps its whole [A, T] segment so the sequence forward can replay it
            # from the memory stored at the rollout's start.
            seg = lambda x: x.permute(1, 2, 0, *range(3, x.dim()))  # noqa: E731 [T, N, A, ...] -> [N, A, T, ...]
            obs = seg(b["obs"])
            batch = PPOBatch(
                obs=obs, critic_obs=b["states"].transpose(0, 1) if "states" in b else obs, actions=seg(b["actions"]),
                logprobs=seg(b["logprobs"]), advantages=seg(adv), returns=seg(ret), values=seg(values), mask=seg(mask),
                rows=torch.arange(self.N, device=self.device), resets=seg(b["resets"]), env_active=seg(b["env_active"]),
            )
        else:
            # Rows are (step, env) pairs; the agent axis stays whole so per-role layers see their slots.
            slots = self.update_slots
            flat = lambda x: (x if slots is None else x.index_select(2, slots)).flatten(0, 1)  # noqa: E731
            obs = flat(b["obs"])
            batch = PPOBatch(
                obs=obs, critic_obs=flat(b["states"]) if "states" in b else obs, actions=flat(b["actions"]),
                logprobs=flat(b["logprobs"]), advantages=flat(adv), returns=flat(ret), values=flat(values), mask=flat(mask),
            )
        if cfg.anneal_lr:
            frac = 1.0 - self.update_idx / max(1, self.num_updates)
            for g in self.optimizer.param_groups:
                g["lr"] = cfg.lr * frac
        metrics = ppo_update(
            self._evaluate_fn, self.params, self.optimizer, batch,
            num_epochs=cfg.num_epochs, num_minibatches=cfg.num_minibatches, clip_coef=cfg.clip_coef,
            vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, max_grad_norm=cfg.max_grad_norm,
            clip_vloss=cfg.clip_vloss, norm_adv=cfg.norm_adv, target_kl=cfg.target_kl or None, generator=self.gen,
            sync_grads=(lambda: self.dist.average_grads(self.params)) if self.dist.enabled else None,
            sync_mean=self.dist.mean if self.dist.enabled else None,
        )
        self._last_batch = batch
        return metrics

    @property
    def num_updates(self) -> int:
        return max(1, math.ceil(self.cfg.total_steps / self.steps_per_update))

    @property
    def steps_per_update(self) -> int:
        """Environment steps of one update, summed over ranks."""
        return self.cfg.batch_size * self.dist.world

    # -- state -----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            for k, v in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"optim.{i}.{k}"] = v
        for k, v in self.norms.state_dict().items():
            out[f"norms.{k}"] = v
        for k, v in self.env.state_dict().items():
            out[f"env.{k}"] = v
        rec = self.record
        for k in ("obs", "active"):
            out[f"record.{k}"] = getattr(rec, k)
        if rec.state is not None:
            out["record.state"] = rec.state
        out["trainer.ep_return"] = self.ep_return
        out["trainer.ep_length"] = self.ep_length
        out["trainer.team_return"] = self.team_return
        if self.recurrent:
            out["trainer.prev_done"] = self.prev_done
            for k in dataclasses.fields(self.memory):
                out[f"memory.{k.name}"] = getattr(self.memory, k.name)
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
            "lr": [g["lr"] for g in self.optimizer.param_groups],
            "recent_returns": self.recent_returns,
            "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
            "numpy_rng": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        }
        if self.league is not None:
            meta["league"] = self.league.state_json(self.global_step)
        meta["world_size"] = self.dist.world
        state = self.dist.gather_state(self.state_tensors())  # every rank takes part
        self._last_ckpt_step = self.global_step
        if not self.main:
            self.dist.barrier()
            return ckpt.checkpoint_path(self.run_dir, self.global_step)
        path = ckpt.save_checkpoint(
            self.run_dir, self.global_step, self.model.state_dict(), state, meta, self.cfg.keep_checkpoints
        )
        if self.league is not None:
            from phalanx.league import LEAGUE_FILE

            (self.run_dir / LEAGUE_FILE).parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_json_atomic(self.run_dir / LEAGUE_FILE, meta["league"])
            self.league.prune_files()
        runs.write_metric_csvs(self.run_dir)
        self.dist.barrier()
        return path

    def restore(self, path: Path) -> None:
        model_t, state_t, meta = ckpt.load_checkpoint(path)
        check_compatible(path, meta, self.cfg, self.model)
        saved_world = int(meta.get("world_size", 1))
        if saved_world != self.dist.world:
            raise CheckpointError(f"checkpoint '{path}' was written by {saved_world} processes; resume it with "
                                  f"torchrun --nproc-per-node {saved_world} (this run has {self.dist.world})")
        state_t = self.dist.local_state(state_t)
        try:
            self.model.load_state_dict(model_t)
        except RuntimeError as e:
            raise CheckpointError(f"checkpoint '{path}' does not fit this model: {str(e).splitlines()[0]}") from None
        dev = self.device
        for i, p in enumerate(self.params):
            st = {k.split(".", 2)[2]: v for k, v in state_t.items() if k.startswith(f"optim.{i}.")}
            if st:
                self.optimizer.state[p] = {k: (v if k == "step" else v.to(dev)) for k, v in st.items()}
        for g, lr in zip(self.optimizer.param_groups, meta["lr"]):
            g["lr"] = lr
        self.norms.load_state_dict({k[6:]: v.to(dev) for k, v in state_t.items() if k.startswith("norms.")})
        self.env.load_state_dict({k[4:]: v for k, v in state_t.items() if k.startswith("env.")})
        rec = self.record
        rec.obs = state_t["record.obs"].to(dev)
        rec.active = state_t["record.active"].to(dev)
        if "record.state" in state_t:
            rec.state = state_t["record.state"].to(dev)
        self.ep_return = state_t["trainer.ep_return"].to(dev)
        self.ep_length = state_t["trainer.ep_length"].to(dev)
        self.team_return = state_t["trainer.team_return"].to(dev)
        if self.recurrent:
            self.prev_done = state_t["trainer.prev_done"].to(dev)
            self.memory = type(self.memory)(**{k.name: state_t[f"memory.{k.name}"].to(dev) for k in dataclasses.fields(self.memory)})
        if self.league is not None:
            self.league.load(self._league_state(path, meta), state_t)
        set_generator_state(self.gen, state_t["trainer.rng"])
        torch.set_rng_state(state_t["torch.rng"])
        self.global_step = int(meta["global_step"])
        self.update_idx = int(meta["update"])
        self._last_ckpt_step = self.global_step
        self.recent_returns = list(meta.get("recent_returns", []))
        pr = meta["python_rng"]
        random.setstate((pr[0], tuple(pr[1]), pr[2]))
        nr = meta["numpy_rng"]
        np.random.set_state((nr[0], np.array(nr[1], dtype=np.uint32), nr[2], nr[3], nr[4]))

    def _league_state(self, path: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """The league state saved with the checkpoint, or league.json where it is the same step's
        state plus the games `phalanx eval` rated since."""
        from phalanx.league import LEAGUE_FILE

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

    # -- loop ------------------------------------------------------------------------------------
    def _open_logs(self) -> None:
        runs_dir = self.run_dir
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # The checkpoint holds the row logged at its own step; later events are from lost updates.
            self.writer = SummaryWriter(str(runs_dir / "tb"), purge_step=self.global_step + 1 if self.resume else None)
        self.metrics_file = open(runs_dir / "metrics.jsonl", "a")

    def _log(self, row: dict[str, Any]) -> None:
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        if self.writer is not None:
            step = row["step"]
            for k, v in row.items():
                if k in ("step", "update") or v is None:
                    continue
                if k.startswith("env_reward_"):
                    group = "reward_terms"
                elif k.startswith("league_"):
                    group = "league"
                else:
                    group = "charts" if k.startswith(("episode", "team", "env_", "success", "sps", "lr")) else "losses"
                self.writer.add_scalar(f"{group}/{k}", v, step)

    def _save_nonfinite(self, metrics: dict[str, float]) -> Path:
        out = self.run_dir / f"nonfinite_update_{self.update_idx:06d}"
        out.mkdir(exist_ok=True)
        b = self._last_batch
        save_file({k: getattr(b, k).detach().cpu().clone() for k in b.__dataclass_fields__ if getattr(b, k) is not None},
                  str(out / "batch.safetensors"))
        ckpt.write_json_atomic(out / "config.json", self.cfg.to_dict())
        ckpt.write_json_atomic(out / "metrics.json", metrics)
        return out

    def train(self, max_updates: int | None = None) -> RunResult:
        """Run until `total_steps` (or `max_updates` more updates, for tests and notebooks)."""
        cfg = self.cfg
        if self.main:
            self._open_logs()
        progress = Progress(cfg.total_steps, enabled=cfg.progress and self.main, start=self.global_step)
        done_updates = 0
        last_row: dict[str, Any] = {}
        try:
            while self.global_step < cfg.total_steps and (max_updates is None or done_updates < max_updates):
                t0 = time.perf_counter()
                stats = self.collect()
                self.global_step += self.steps_per_update
                if self.dist.enabled:  # pooled statistics keep the ranks' normalisers identical
                    self.dist.pool_stats(self.norms.obs)
                    self.dist.pool_stats(self.norms.reward.stats if self.norms.reward is not None else None)
                metrics = self.update()
                if self.dist.enabled:
                    self.dist.pool_stats(self.norms.value)
                self.update_idx += 1
                done_updates += 1
                # The one host read per update.
                names = list(METRIC_NAMES) + list(stats)
                means = self.dist.mean(torch.stack([metrics[k].float() for k in METRIC_NAMES]))
                sums = self.dist.sum(torch.stack([stats[k].float() for k in stats]))
                values = torch.cat([means, sums]).tolist()
                row_vals = dict(zip(names, values))
                dt = time.perf_counter() - t0
                row: dict[str, Any] = {"step": self.global_step, "update": self.update_idx}
                eps = row_vals.pop("episodes")
                ret_sum, len_sum = row_vals.pop("ep_return_sum"), row_vals.pop("ep_length_sum")
                team_eps, team_sum = row_vals.pop("team_episodes"), row_vals.pop("team_return_sum")
                info = {k[5:]: row_vals.pop(k) for k in list(row_vals) if k.startswith("info_")}
                row["episodes"] = int(eps)
                if eps > 0:
                    row["episode_return"] = ret_sum / eps
                    row["episode_length"] = len_sum / eps
                    self.recent_returns = (self.recent_returns + [row["episode_return"]])[-10:]
                if self.A == 1:
                    team_eps = eps  # one slot: the env's episodes are the agent's
                if team_eps > 0 and self.A > 1:
                    row["team_return"] = team_sum / team_eps
                    for k, v in info.items():
                        row[f"env_{k}"] = v / team_eps
                if team_eps > 0 and self.env.success_key in info:
                    row["success_rate"] = info[self.env.success_key] / team_eps
                if self.league is not None:
                    row.update(self.league.end_update(self.global_step, self.model, self.norms.obs))
                nonfinite = row_vals.pop("nonfinite")
                env_bad, first_bad = row_vals.pop("env_nonfinite"), row_vals.pop("env_first_bad_step")
                if env_bad > 0:
                    row["env_nonfinite"] = env_bad
                    if cfg.nonfinite_env == "stop":
                        step = self.global_step - self.steps_per_update + int(first_bad) * cfg.num_envs * self.dist.world
                        where = self._save_nonfinite(row)
                        raise NonFiniteEnvError(
                            f"env '{cfg.env}' returned {int(env_bad)} NaN or infinite values (observations, states or "
                            f"rewards), first at rollout step {int(first_bad)} of update {self.update_idx} (about step "
                            f"{step}); batch and config saved to '{where}'; set nonfinite_env=zero to replace them with 0")
                row.update({k: v for k, v in row_vals.items()})
                row["lr"] = self.optimizer.param_groups[0]["lr"]
                row["sps"] = self.steps_per_update / dt
                row["time"] = time.time()
                if nonfinite > 0 or not all(math.isfinite(v) for v in row_vals.values()):
                    where = self._save_nonfinite(row)
                    raise NonFiniteLossError(
                        f"loss became non-finite at update {self.update_idx} (step {self.global_step}); "
                        f"batch and config saved to '{where}'; last good checkpoint: "
                        f"{ckpt.list_checkpoints(self.run_dir)[-1] if ckpt.list_checkpoints(self.run_dir) else 'none'}"
                    )
                if self.main:
                    self._log(row)
                self.history.append(row)
                last_row = row
                recent = sum(self.recent_returns) / len(self.recent_returns) if self.recent_returns else float("nan")
                progress.update(self.global_step, row["sps"], recent)
                if self.global_step - self._last_ckpt_step >= self.checkpoint_every:
                    self.save()
            if self._last_ckpt_step != self.global_step:
                self.save()
        finally:
            progress.close()
            if self.main:
                self.metrics_file.close()
                if self.writer is not None:
                    self.writer.close()
        final = dict(last_row)
        if self.global_step >= cfg.total_steps and cfg.eval_episodes > 0 and self.main:
            from phalanx.evaluate import evaluate_policy

            ev = evaluate_policy(self.policy(), cfg.env, cfg.env_options, episodes=cfg.eval_episodes, seed=cfg.seed + 7777, device=self.device)
            final.update({f"eval_{k}": v for k, v in ev.items() if isinstance(v, (int, float))})
            ckpt.write_json_atomic(self.run_dir / "eval.json", ev)
        # Ranks leave together: one that tore its process group down while rank 0 still evaluated was
        # once aborted by gloo ("terminate called without an active exception") on a loaded machine.
        self.dist.barrier()
        return RunResult(self.run_dir, final, self.policy(), cfg, list(self.history))

    def policy(self):
        from phalanx.policy import Policy

        return Policy(self.model, self.norms.obs, self.cfg, self.env.observation_space, self.env.action_space)

    def close(self) -> None:
        """Release what the run holds; safe on a trainer whose construction failed part-way."""
        if self.env is not None:
            self.env.close()
        if self.lock is not None:
            self.lock.release()
        self.dist.close()


def check_compatible(path: Path, meta: dict[str, Any], cfg: Config, model: nn.Module) -> None:
    """A checkpoint from another env or another model shape is refused, naming the mismatch."""
    saved = meta.get("config", {})
    if meta.get("env") != cfg.env:
        raise CheckpointError(f"checkpoint '{path}' is for env '{meta.get('env')}', not '{cfg.env}'")
    shapes = meta.get("model_shapes", {})
    for k, v in model.state_dict().items():
        if k not in shapes:
            raise CheckpointError(f"checkpoint '{path}' lacks parameter '{k}' (model '{saved.get('model')}' {saved.get('hidden_sizes')})")
        if list(v.shape) != shapes[k]:
            raise CheckpointError(f"checkpoint '{path}' parameter '{k}' has shape {shapes[k]}, the model expects {list(v.shape)}")


class Progress:
    """A live bar (rich) on a terminal; a line every 10% of the run otherwise."""

    def __init__(self, total: int, enabled: bool, start: int = 0):
        self.total, self.enabled = total, enabled
        self._bar = None
        self._next_line = 0.1
        if not enabled:
            return
        if sys.stderr.isatty():
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} steps"),
                TextColumn("{task.fields[sps]:>9,.0f} steps/s"), TextColumn("return {task.fields[ret]:>8.2f}"),
                TimeRemainingColumn(), transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, sps=0.0, ret=float("nan"))
            self._bar.start()

    def update(self, step: int, sps: float, ret: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=min(step, self.total), sps=sps, ret=ret)
        elif step / self.total >= self._next_line or step >= self.total:
            print(f"step {step:>10,}/{self.total:,}  {sps:>9,.0f} steps/s  return {ret:8.2f}", file=sys.stderr, flush=True)
            while self._next_line <= step / self.total:
                self._next_line += 0.1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def load_run_config(run_dir: Path) -> Config:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"'{run_dir}' is not a run directory (no config.json)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"run file '{path}' is not valid JSON: {e}") from None
    return resolve(data)


def train(config: Config | str | Path | dict | None = None, *, resume: str | Path | None = None, max_updates: int | None = None, **overrides: Any) -> RunResult:
    """Train a policy. `config` is a Config, a YAML/TOML file or a mapping; keywords override keys.

    `resume=RUN_DIR` continues a stopped run from its last checkpoint.
    """
    from phalanx.config import load_file

    if resume is not None:
        run_dir = Path(resume)
        saved = load_run_config(run_dir).to_dict()
        for k, v in overrides.items():
            if k not in RESUME_MUTABLE and k in saved and v != saved[k]:
                raise ConfigError(f"config key '{k}' cannot change on resume (run has {saved[k]!r}, got {v!r})")
        cfg = resolve(saved, overrides)
        trainer = Trainer(cfg, run_dir=run_dir, resume=True)
        try:
            trainer.restore(ckpt.latest_checkpoint(run_dir))
            if trainer.main:
                runs.truncate_metrics(run_dir, trainer.global_step)
                ckpt.write_json_atomic(run_dir / "config.json", cfg.to_dict())
            return trainer.train(max_updates=max_updates)
        finally:
            trainer.close()
    layers: list[dict[str, Any]] = []
    if isinstance(config, Config):
        layers.append(config.to_dict())
    elif isinstance(config, (str, Path)):
        layers.append(load_file(config))
    elif isinstance(config, dict):
        layers.append(config)
    layers.append(overrides)
    cfg = resolve(*layers)
    trainer = Trainer(cfg)
    try:
        if ckpt.list_checkpoints(trainer.run_dir):
            raise ConfigError(f"run directory '{trainer.run_dir}' already holds a run; use --resume {trainer.run_dir} or another --run-dir")
        if trainer.main:
            ckpt.write_json_atomic(trainer.run_dir / "config.json", {**cfg.to_dict(), "run_dir": str(trainer.run_dir)})
            ckpt.write_json_atomic(trainer.run_dir / "manifest.json",
                                   {**runs.manifest(trainer.device, cfg.seed), "world_size": trainer.dist.world})
        return trainer.train(max_updates=max_updates)
    finally:
        trainer.close()
