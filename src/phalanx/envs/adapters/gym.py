"""Any installed gymnasium env as a phalanx VecEnv, named `gym:<env id>` (e.g. `gym:CartPole-v1`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.registry import EnvSpec, register, register_prefix
from phalanx.envs.spaces import Box, Discrete, MultiDiscrete, Space
from phalanx.errors import ConfigError, MissingExtraError


def _finite(values: np.ndarray) -> bool:
    """Whether every element is finite: by the sum, finite exactly where every element is unless it
    overflows (then False, and the trainer's exact test decides)."""
    return math.isfinite(values.sum())


def _torch_dtype(dtype: Any) -> torch.dtype:
    return torch.uint8 if np.dtype(dtype) == np.uint8 else torch.float32


def _map_obs_space(space: Any) -> tuple[Space, bool]:
    """(phalanx space, whether observations must go through gymnasium's `flatten`)."""
    from gymnasium import spaces as gs

    if isinstance(space, gs.Box):
        if np.dtype(space.dtype) == np.bool_:  # PettingZoo's chess and go: boolean planes, observed as 0 / 1 floats
            return Box(space.low.astype(np.float32), space.high.astype(np.float32), space.shape), False
        return Box(space.low, space.high, space.shape, _torch_dtype(space.dtype)), False
    # Discrete, Dict, Tuple, MultiBinary, ...: one flat float vector (Discrete becomes one-hot).
    flat = gs.flatten_space(space)
    if not isinstance(flat, gs.Box):
        raise ConfigError(f"gym observation space {space} cannot be flattened to a Box")
    return Box(tuple(flat.low.ravel().tolist()), tuple(flat.high.ravel().tolist()), flat.shape), True


def _map_action_space(space: Any, env_id: str) -> Space:
    from gymnasium import spaces as gs

    if isinstance(space, gs.Discrete):
        return Discrete(int(space.n))
    if isinstance(space, gs.MultiDiscrete) and space.nvec.ndim == 1:
        return MultiDiscrete(tuple(int(n) for n in space.nvec))
    if isinstance(space, gs.Box):
        return Box(space.low, space.high, space.shape)
    raise ConfigError(f"gym env '{env_id}' has an unsupported action space {space}")


def gym_space_of(space: Space) -> Any:
    """A phalanx per-agent space as the equivalent gymnasium space."""
    from gymnasium import spaces as gs

    if isinstance(space, Discrete):
        return gs.Discrete(space.n)
    if isinstance(space, MultiDiscrete):
        return gs.MultiDiscrete(np.asarray(space.nvec, dtype=np.int64))
    if isinstance(space, Box):
        dtype = np.uint8 if space.dtype == torch.uint8 else np.float32
        low = np.asarray(space.low, dtype=np.float64).reshape(space.shape)
        high = np.asarray(space.high, dtype=np.float64).reshape(space.shape)
        if dtype == np.uint8:
            return gs.Box(low.astype(np.uint8), high.astype(np.uint8), shape=space.shape, dtype=np.uint8)
        return gs.Box(low.astype(np.float32), high.astype(np.float32), shape=space.shape, dtype=np.float32)
    raise ConfigError(f"space {space!r} has no gymnasium equivalent")


class GymVecEnv(VecEnv):
    """A gymnasium env id run as `num_envs` copies stepped in one loop (same-step autoreset, as
    gymnasium's `SyncVectorEnv`) with torch tensors on `device`; with `vectorization_mode="async"`
    (`--vectorization-mode async`) as gymnasium's `AsyncVectorEnv`, one process per copy, for envs
    whose step is slow enough to pay for the pipes.

    Env i is seeded with `seed + i` at the first reset (or at `reset(seed)`). Stepping copies
    actions to the host, so this is for checks and small runs, not speed. `state_dict` is empty:
    gymnasium envs cannot be saved and restored bit-identically, so a resumed run re-seeds them.
    """

    restorable = False  # gymnasium envs cannot be saved: a resume re-seeds them (VecEnv.state_dict is empty)

    def __init__(self, env_id: str, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0,
                 vectorization_mode: str = "sync", **options: Any) -> None:
        import gymnasium as gym
        from gymnasium import spaces as gs
        from gymnasium.vector import AsyncVectorEnv, AutoresetMode

        if vectorization_mode not in ("sync", "async"):
            raise ConfigError(f"env option 'vectorization_mode' of 'gym:{env_id}' must be one of sync, async; got {vectorization_mode!r}")

        try:
            probe = gym.make(env_id, **options)  # fail here, with one line, on a bad id or option
        except gym.error.DependencyNotInstalled as e:  # e.g. Box2D for LunarLander: listed all the same by `phalanx envs`
            raise MissingExtraError(f"gym env '{env_id}' needs a package gymnasium leaves out: {str(e).splitlines()[0]}") from None
        except gym.error.Error as e:
            raise ConfigError(f"unknown gym env '{env_id}': {str(e).splitlines()[0]}") from None
        except TypeError as e:
            raise ConfigError(f"gym env '{env_id}' rejected options {options}: {str(e).splitlines()[0]}") from None
        # Frames for --record: gymnasium draws an image only when asked (render_mode rgb_array renders
        # lazily, on `render()`), so every copy is made able to.
        self.renders = "render_mode" not in options and "rgb_array" in probe.metadata.get("render_modes", ())
        self._single_obs, self._single_act = probe.observation_space, probe.action_space
        probe.close()
        make_options = {**options, "render_mode": "rgb_array"} if self.renders else options
        # The sync copies are stepped here rather than by gymnasium's SyncVectorEnv, whose batching costs
        # more than a cheap env's own step (measured: docs/BENCHMARKS.md, "Hot-path choices").
        self.envs = [gym.make(env_id, **make_options) for _ in range(num_envs)] if vectorization_mode == "sync" else []
        self.vec = (AsyncVectorEnv([lambda: gym.make(env_id, **make_options) for _ in range(num_envs)],
                                   autoreset_mode=AutoresetMode.SAME_STEP) if vectorization_mode == "async" else None)
        self.name = f"gym:{env_id}"
        self.num_envs = num_envs
        self.device = torch.device(device)
        self._on_host = self.device.type == "cpu"
        self.roles = self.default_roles()
        self.observation_space, self._flatten = _map_obs_space(self._single_obs)
        self.action_space = _map_action_space(self._single_act, env_id)
        self._pending_seed = seed
        self._obs_np_dtype = np.uint8 if self.observation_space.dtype == torch.uint8 else np.float32
        self._obs_shape = (num_envs, 1, *self.observation_space.shape)
        self._discrete_act = isinstance(self._single_act, (gs.Discrete, gs.MultiDiscrete))
        self._act_start = self._single_act.start if self._discrete_act else 0  # gymnasium spaces may start at non-zero
        self._flatten_one = gs.flatten
        # Every step's (constant) flags: records are never written in place.
        self._all_active = torch.ones(num_envs, 1, dtype=torch.bool, device=self.device)
        self._all_false = torch.zeros(num_envs, 1, dtype=torch.bool, device=self.device)
        self._no_episode = torch.zeros(num_envs, 1, device=self.device)
        self._ep_return = [0.0] * num_envs
        self._ep_length = [0] * num_envs

    def _obs_one(self, o: Any) -> np.ndarray:
        return self._flatten_one(self._single_obs, o) if self._flatten else o

    def _tensor(self, host: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(host)
        return t if self._on_host else t.to(self.device)

    def _batch_obs(self, obs: Any) -> np.ndarray:
        """A vector env's batched observation as [N, 1, *obs_shape] on the host."""
        out = np.empty(self._obs_shape, self._obs_np_dtype)
        if not self._flatten:
            out[:, 0] = obs
            return out
        from gymnasium.vector.utils import iterate

        for i, o in enumerate(iterate(self.vec.observation_space, obs)):
            out[i, 0] = self._obs_one(o)
        return out

    def reset(self, seed: int | None = None) -> StepRecord:
        seed = self._pending_seed if seed is None else seed
        self._pending_seed = None
        seeds = [None] * self.num_envs if seed is None else [seed + i for i in range(self.num_envs)]
        if self.vec is not None:
            obs = self._batch_obs(self.vec.reset(seed=None if seed is None else seeds)[0])
        else:
            obs = np.empty(self._obs_shape, self._obs_np_dtype)
            for i, (env, s) in enumerate(zip(self.envs, seeds)):
                obs[i, 0] = self._obs_one(env.reset(seed=s)[0])
        self._ep_return = [0.0] * self.num_envs
        self._ep_length = [0] * self.num_envs
        o = self._tensor(obs)
        false = torch.zeros(self.num_envs, 1, dtype=torch.bool, device=self.device)
        zero = torch.zeros(self.num_envs, 1, device=self.device)
        return StepRecord(obs=o, reward=zero, terminated=false, truncated=false.clone(),
                          active=~false, trial_end=false.clone(), final_obs=o)

    def _step_copies(self, actions: Any, obs: np.ndarray) -> tuple[list[float], list[tuple[int, Any, bool, bool]]]:
        """Step each copy, writing its observation (the next episode's first where one ended) into `obs`;
        -> the rewards, and (env index, final observation, terminated, truncated) of the episodes that ended."""
        rewards, ended = [], []
        ret, length, flat = self._ep_return, self._ep_length, self._flatten
        for i, env in enumerate(self.envs):
            o, r, term, trunc, _ = env.step(actions[i])
            rewards.append(r)
            ret[i] += r
            length[i] += 1
            if term or trunc:
                ended.append((i, o, term, trunc))
                o = env.reset()[0]
            obs[i, 0] = self._obs_one(o) if flat else o
        return rewards, ended

    def _step_async(self, actions: Any, obs: np.ndarray) -> tuple[list[float], list[tuple[int, Any, bool, bool]]]:
        """As `_step_copies`, through gymnasium's AsyncVectorEnv."""
        batch, reward, terminated, truncated, info = self.vec.step(actions)
        obs[:] = self._batch_obs(batch)
        rewards = reward.tolist()
        for i, r in enumerate(rewards):
            self._ep_return[i] += r
            self._ep_length[i] += 1
        final = info["final_obs"] if "_final_obs" in info else None
        return rewards, [(int(i), final[i], bool(terminated[i]), bool(truncated[i])) for i in np.flatnonzero(terminated | truncated)]

    def step(self, actions: torch.Tensor) -> StepRecord:
        # Few host-device conversions a step: at CleanRL's 4 envs each one cost as much as an env's step.
        actions = self.action_space.check(actions, self.num_envs, self.num_agents, values=True)
        a = (actions.detach() if actions.requires_grad else actions)
        a = (a if self._on_host else a.cpu()).numpy().reshape((self.num_envs, *self._single_act.shape))
        if self._discrete_act:
            a = a.astype(np.int64) + self._act_start if self._act_start else a
        else:
            a = a.astype(self._single_act.dtype)
        # Fresh host arrays each step (a record is never written in place); where no episode ended, the
        # flags and episode statistics are the constant all-false / zero tensors.
        obs = np.empty(self._obs_shape, self._obs_np_dtype)
        rewards, ended = (self._step_copies if self.vec is None else self._step_async)(a, obs)
        rewards_np = np.array(rewards, np.float32).reshape(self.num_envs, 1)
        o, reward = self._tensor(obs), self._tensor(rewards_np)
        # Tested here on the host's arrays: cheaper than the trainer's torch test of the tensors.
        finite = _finite(obs) and math.isfinite(sum(rewards))  # the list's own sum: no numpy call for a few numbers
        if not ended:
            return StepRecord(obs=o, reward=reward, terminated=self._all_false, truncated=self._all_false,
                              active=self._all_active, trial_end=self._all_false, final_obs=o,
                              info={"episode_return": self._no_episode, "episode_length": self._no_episode},
                              quiet=True, finite=finite)
        final = obs.copy()
        # Terminated and truncated flags, episode return and length where an episode ended, made on the host
        # (torch comparisons of float columns cost a CartPole step's worth).
        flags = np.zeros((2, self.num_envs, 1), np.bool_)
        episode = np.zeros((2, self.num_envs, 1), np.float32)
        for i, fo, term, trunc in ended:
            final[i, 0] = self._obs_one(fo)
            flags[0, i, 0], flags[1, i, 0] = term, trunc
            episode[0, i, 0], episode[1, i, 0] = self._ep_return[i], self._ep_length[i]
            self._ep_return[i], self._ep_length[i] = 0.0, 0
        terminated, truncated = self._tensor(flags)
        ep_return, ep_length = self._tensor(episode)
        return StepRecord(obs=o, reward=reward, terminated=terminated, truncated=truncated, active=self._all_active,
                          trial_end=self._all_false, final_obs=self._tensor(final),
                          info={"episode_return": ep_return, "episode_length": ep_length}, finite=finite and _finite(final))

    def render(self, env_index: int = 0) -> torch.Tensor:
        """Copy `env_index`'s frame from gymnasium's `render()` (render_mode rgb_array)."""
        if not self.renders:
            raise NotImplementedError(f"gym env '{self.name}' has no rgb_array render mode")
        frame = self.envs[env_index].render() if self.vec is None else self.vec.call("render")[env_index]
        frame = np.asarray(frame, dtype=np.uint8)
        return torch.from_numpy(np.ascontiguousarray(frame[..., :3]))

    def close(self) -> None:
        for env in self.envs:
            env.close()
        if self.vec is not None:
            self.vec.close()


def _make_gym(rest: str, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0, **options: Any) -> GymVecEnv:
    try:
        import gymnasium  # noqa: F401
    except ImportError:
        raise ConfigError(f"env 'gym:{rest}' needs gymnasium; install it with `pip install gymnasium`") from None
    return GymVecEnv(rest, num_envs=num_envs, device=device, seed=seed, **options)


register_prefix("gym", _make_gym)

# Tasks whose tuned PPO settings a peer publishes, as the training defaults of their `gym:` name (under a user's
# config, like a built-in env's), so that `phalanx train --env gym:LunarLander-v3` learns without copying them.
# Each is measured against the peer's own table in phalanx_bench/studies/learning_parity.py (docs/BENCHMARKS.md).
TUNED: dict[str, tuple[str, dict[str, Any]]] = {
    # The RL Zoo's ppo.yml entry (Stable-Baselines3): the learning rate constant, the value loss unclipped (the
    # schema's default too; clipped, the same 1M steps reached 95.7 sampled against 252.0, seed 1).
    "LunarLander-v3": ("the RL Zoo's PPO settings (Stable-Baselines3)", {
        "num_envs": 16, "num_steps": 1024, "num_minibatches": 256, "num_epochs": 4, "gamma": 0.999, "gae_lambda": 0.98,
        "ent_coef": 0.01, "lr": 3e-4, "anneal_lr": False, "clip_vloss": False, "total_steps": 1_000_000}),
    # The RL Zoo's entry less its gSDE exploration, which Phalanx does not have: -192.4 greedy over 3 seeds against
    # the Zoo's -172.2 +- 104.2 (bench/parity/pendulum_rlzoo.yaml).
    "Pendulum-v1": ("the RL Zoo's PPO settings (Stable-Baselines3) without gSDE", {
        "num_envs": 4, "num_steps": 1024, "num_minibatches": 64, "num_epochs": 10, "gamma": 0.9, "gae_lambda": 0.95,
        "ent_coef": 0.0, "lr": 1e-3, "anneal_lr": False, "clip_vloss": False, "total_steps": 100_000}),
    # CleanRL's ppo_continuous_action.py, its MuJoCo benchmark's settings (bench/parity/<task>_cleanrl.yaml).
    **{task: ("CleanRL's ppo_continuous_action.py settings", {
        "num_envs": 1, "num_steps": 2048, "num_minibatches": 32, "num_epochs": 10, "lr": 3e-4, "anneal_lr": True,
        "gamma": 0.99, "gae_lambda": 0.95, "ent_coef": 0.0, "clip_vloss": True, "norm_obs": True, "norm_reward": True,
        "obs_clip": 10.0, "total_steps": 1_000_000}) for task in ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5")},
}


def _tuned(env_id: str):
    def factory(num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0, **options: Any) -> GymVecEnv:
        return _make_gym(env_id, num_envs=num_envs, device=device, seed=seed, **options)

    return factory


for _env_id, (_source, _defaults) in TUNED.items():
    register(EnvSpec(name=f"gym:{_env_id}", factory=_tuned(_env_id),
                     description=f"gymnasium {_env_id} with {_source} as its training defaults", train_defaults=dict(_defaults),
                     free_options=True))
