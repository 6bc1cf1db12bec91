"""Any installed gymnasium env as a phalanx VecEnv, named `gym:<env id>` (e.g. `gym:CartPole-v1`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.registry import register_prefix
from phalanx.envs.spaces import Box, Discrete, MultiDiscrete, Space
from phalanx.errors import ConfigError


def _torch_dtype(dtype: Any) -> torch.dtype:
    return torch.uint8 if np.dtype(dtype) == np.uint8 else torch.float32


def _map_obs_space(space: Any) -> tuple[Space, bool]:
    """(phalanx space, whether observations must go through gymnasium's `flatten`)."""
    from gymnasium import spaces as gs

    if isinstance(space, gs.Box):
        return Box(tuple(space.low.ravel().tolist()), tuple(space.high.ravel().tolist()), space.shape, _torch_dtype(space.dtype)), False
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
        return Box(tuple(space.low.ravel().tolist()), tuple(space.high.ravel().tolist()), space.shape)
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
    """A gymnasium env id run as `SyncVectorEnv` (same-step autoreset) with torch tensors on `device`;
    with `vectorization_mode="async"` (`--vectorization-mode async`) as `AsyncVectorEnv`, one process per
    copy, for envs whose step is slow enough to pay for the pipes.

    Env i is seeded with `seed + i` at the first reset (or at `reset(seed)`). Stepping copies
    actions to the host, so this is for checks and small runs, not speed. `state_dict` is empty:
    gymnasium envs cannot be saved and restored bit-identically, so a resumed run re-seeds them.
    """

    restorable = False

    def __init__(self, env_id: str, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0,
                 vectorization_mode: str = "sync", **options: Any) -> None:
        import gymnasium as gym
        from gymnasium import spaces as gs
        from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

        if vectorization_mode not in ("sync", "async"):
            raise ConfigError(f"env option 'vectorization_mode' of 'gym:{env_id}' must be one of sync, async; got {vectorization_mode!r}")

        try:
            probe = gym.make(env_id, **options)  # fail here, with one line, on a bad id or option
        except gym.error.Error as e:
            raise ConfigError(f"unknown gym env '{env_id}': {str(e).splitlines()[0]}") from None
        except TypeError as e:
            raise ConfigError(f"gym env '{env_id}' rejected options {options}: {str(e).splitlines()[0]}") from None
        # Frames for --record: gymnasium draws an image only when asked (render_mode rgb_array renders
        # lazily, on `render()`), so every copy is made able to.
        self.renders = "render_mode" not in options and "rgb_array" in probe.metadata.get("render_modes", ())
        probe.close()
        make_options = {**options, "render_mode": "rgb_array"} if self.renders else options
        vector = SyncVectorEnv if vectorization_mode == "sync" else AsyncVectorEnv
        self.vec = vector([lambda: gym.make(env_id, **make_options) for _ in range(num_envs)],
                          autoreset_mode=AutoresetMode.SAME_STEP)
        self.name = f"gym:{env_id}"
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.roles = self.default_roles()
        self._single_obs = self.vec.single_observation_space
        self._single_act = self.vec.single_action_space
        self.observation_space, self._flatten = _map_obs_space(self._single_obs)
        self.action_space = _map_action_space(self._single_act, env_id)
        self._pending_seed = seed
        self._obs_np_dtype = np.uint8 if self.observation_space.dtype == torch.uint8 else np.float32
        self._discrete_act = isinstance(self._single_act, (gs.Discrete, gs.MultiDiscrete))
        self._act_start = self._single_act.start if self._discrete_act else 0  # gymnasium spaces may start at non-zero
        # Every step's (constant) flags: records are never written in place.
        self._all_active = torch.ones(num_envs, 1, dtype=torch.bool, device=self.device)
        self._no_trial_end = torch.zeros(num_envs, 1, dtype=torch.bool, device=self.device)
        self._columns = np.zeros((5, num_envs, 1), dtype=np.float32)
        self._done = np.zeros(num_envs, dtype=bool)
        self._ep_return = np.zeros(num_envs, dtype=np.float64)
        self._ep_length = np.zeros(num_envs, dtype=np.int64)

    def _obs_one(self, o: Any) -> np.ndarray:
        from gymnasium import spaces as gs

        return gs.flatten(self._single_obs, o) if self._flatten else np.asarray(o)

    def _to_torch(self, batch: list[np.ndarray] | np.ndarray) -> torch.Tensor:
        arr = np.stack(batch) if isinstance(batch, list) else batch
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=self._obs_np_dtype)).to(self.device).unsqueeze(1)

    def _batch_obs(self, obs: Any) -> torch.Tensor:
        if not self._flatten:
            return self._to_torch(np.asarray(obs))
        from gymnasium.vector.utils import iterate

        return self._to_torch([self._obs_one(o) for o in iterate(self.vec.observation_space, obs)])

    def _step_columns(self, reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> list[torch.Tensor]:
        """reward, episode return and length (where an episode ended, else 0), terminated and truncated as
        [N, 1] float32 tensors on the device: written into one host array, copied to the device once."""
        host = self._columns
        host[0, :, 0] = reward
        done = np.logical_or(terminated, truncated, out=self._done)
        self._ep_return += reward
        self._ep_length += 1
        host[1, :, 0] = np.where(done, self._ep_return, 0.0)
        host[2, :, 0] = np.where(done, self._ep_length, 0)
        host[3, :, 0] = terminated
        host[4, :, 0] = truncated
        self._ep_return[done] = 0
        self._ep_length[done] = 0
        return list(torch.tensor(host, device=self.device).unbind(0))

    def reset(self, seed: int | None = None) -> StepRecord:
        seed = self._pending_seed if seed is None else seed
        self._pending_seed = None
        obs, _ = self.vec.reset(seed=None if seed is None else [seed + i for i in range(self.num_envs)])
        self._ep_return[:] = 0
        self._ep_length[:] = 0
        o = self._batch_obs(obs)
        false = torch.zeros(self.num_envs, 1, dtype=torch.bool, device=self.device)
        zero = torch.zeros(self.num_envs, 1, device=self.device)
        return StepRecord(obs=o, reward=zero, terminated=false, truncated=false.clone(),
                          active=~false, trial_end=false.clone(), final_obs=o)

    def step(self, actions: torch.Tensor) -> StepRecord:
        # Few host-device conversions a step: at CleanRL's 4 envs each one cost as much as an env's step.
        actions = self.action_space.check(actions, self.num_envs, self.num_agents, values=True)
        a = actions.detach().cpu().numpy().reshape((self.num_envs, *self._single_act.shape))
        a = a.astype(np.int64) + self._act_start if self._discrete_act else a.astype(self._single_act.dtype)
        obs, reward, terminated, truncated, info = self.vec.step(a)
        o = self._batch_obs(obs)
        mask = info.get("_final_obs")
        if mask is not None and mask.any():
            idx = np.flatnonzero(mask)
            final = o.clone()
            final[torch.as_tensor(idx, device=self.device)] = self._to_torch([self._obs_one(info["final_obs"][i]) for i in idx])
        else:
            final = o
        reward_t, ep_return, ep_length, terminated_t, truncated_t = self._step_columns(reward, terminated, truncated)
        return StepRecord(
            obs=o,
            reward=reward_t,
            terminated=terminated_t > 0,
            truncated=truncated_t > 0,
            active=self._all_active,
            trial_end=self._no_trial_end,
            final_obs=final,
            info={"episode_return": ep_return.squeeze(1), "episode_length": ep_length.squeeze(1)},
        )

    def render(self, env_index: int = 0) -> torch.Tensor:
        """Copy `env_index`'s frame from gymnasium's `render()` (render_mode rgb_array)."""
        if not self.renders:
            raise NotImplementedError(f"gym env '{self.name}' has no rgb_array render mode")
        frame = np.asarray(self.vec.call("render")[env_index], dtype=np.uint8)
        return torch.from_numpy(np.ascontiguousarray(frame[..., :3]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Empty: gymnasium envs cannot be restored bit-identically (a resume re-seeds them)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore (see `state_dict`); the envs keep their current episodes."""

    def close(self) -> None:
        self.vec.close()


def _make_gym(rest: str, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0, **options: Any) -> GymVecEnv:
    try:
        import gymnasium  # noqa: F401
    except ImportError:
        raise ConfigError(f"env 'gym:{rest}' needs gymnasium; install it with `pip install gymnasium`") from None
    return GymVecEnv(rest, num_envs=num_envs, device=device, seed=seed, **options)


register_prefix("gym", _make_gym)
