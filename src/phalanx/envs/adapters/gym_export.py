"""A single-agent Phalanx env for other libraries: a `gymnasium.vector.VectorEnv` (CleanRL-style loops)
and a Stable-Baselines3 `VecEnv`. Both hand numpy arrays to the host, one batch per step.

Boundaries keep their meaning: gymnasium gets `terminations` and `truncations` apart and, as its
same-step autoreset mode says, the last observation of an ended episode in `infos["final_obs"]`
(mask `infos["_final_obs"]`); SB3 gets `done` with `infos[i]["terminal_observation"]` and
`infos[i]["TimeLimit.truncated"]`, which its algorithms read to bootstrap time limits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phalanx.envs.adapters.gym import gym_space_of
from phalanx.envs.base import VecEnv
from phalanx.envs.spaces import Box
from phalanx.errors import ConfigError


def _single_agent(env: VecEnv, what: str) -> None:
    if env.num_agents != 1:
        raise ConfigError(f"{what} takes a single-agent env; '{env.name}' has {env.num_agents} agent slots "
                          "(use phalanx.envs.to_pettingzoo for multi-agent envs)")


class _Bridge:
    """Host-side conversions of the gymnasium export."""

    def __init__(self, env: VecEnv):
        self.env = env
        self.is_box = isinstance(env.action_space, Box)

    def actions(self, actions: Any) -> torch.Tensor:
        a = torch.as_tensor(np.asarray(actions))
        a = a.float() if self.is_box else a.long()
        return a.reshape(self.env.num_envs, 1, *self.env.action_space.shape).to(self.env.device)

    @staticmethod
    def numpy(x: torch.Tensor) -> np.ndarray:
        return x[:, 0].cpu().numpy()

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """-> obs, final_obs, reward, terminated, truncated of the batch, as numpy."""
        rec = self.env.step(self.actions(actions))
        return tuple(self.numpy(x) for x in (rec.obs, rec.final_obs, rec.reward, rec.terminated, rec.truncated))


def to_gymnasium(env: VecEnv) -> Any:
    """`env` (single agent) as a `gymnasium.vector.VectorEnv` with same-step autoreset."""
    _single_agent(env, "to_gymnasium")
    return _vector_env_class()(env)


def to_sb3(env: VecEnv) -> Any:
    """`env` (single agent) as a Stable-Baselines3 `VecEnv`: SB3's interface over `to_gymnasium(env)`
    (needs stable-baselines3)."""
    _single_agent(env, "to_sb3")
    try:
        cls = _sb3_class()
    except ImportError:
        raise ConfigError("to_sb3 needs stable-baselines3; install it with `pip install stable-baselines3`") from None
    return cls(to_gymnasium(env))


_CLASSES: dict[str, type] = {}


def _vector_env_class() -> type:
    """Built on first use, so gymnasium's vector module loads only for this export."""
    if "gymnasium" in _CLASSES:
        return _CLASSES["gymnasium"]
    from gymnasium.vector import AutoresetMode, VectorEnv
    from gymnasium.vector.utils import batch_space

    class PhalanxVectorEnv(VectorEnv):
        """A Phalanx env batch as a gymnasium `VectorEnv` (see the module docstring)."""

        metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

        def __init__(self, env: VecEnv):
            self.env, self.bridge = env, _Bridge(env)
            self.num_envs = env.num_envs
            self.single_observation_space = gym_space_of(env.observation_space)
            self.single_action_space = gym_space_of(env.action_space)
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
            self.action_space = batch_space(self.single_action_space, self.num_envs)

        def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
            if isinstance(seed, (list, tuple)):
                seed = seed[0]  # one generator drives the whole batch
            return self.bridge.numpy(self.env.reset(seed=seed).obs), {}

        def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
            obs, final, reward, term, trunc = self.bridge.step(actions)
            infos: dict = {}
            for i in np.flatnonzero(term | trunc):
                infos = self._add_info(infos, {"final_obs": final[i], "final_info": {}}, int(i))
            return obs, reward, term, trunc, infos

        def close_extras(self, **kwargs: Any) -> None:
            self.env.close()

    _CLASSES["gymnasium"] = PhalanxVectorEnv
    return PhalanxVectorEnv


def _sb3_class() -> type:
    if "sb3" in _CLASSES:
        return _CLASSES["sb3"]
    from stable_baselines3.common.vec_env import VecEnv as SB3VecEnv

    class PhalanxSB3VecEnv(SB3VecEnv):
        """A gymnasium `VectorEnv` with same-step autoreset (here: `to_gymnasium`'s) as a
        Stable-Baselines3 `VecEnv` (see the module docstring)."""

        def __init__(self, vec: Any):
            self.vec = vec
            self.render_mode = None
            super().__init__(vec.num_envs, vec.single_observation_space, vec.single_action_space)
            self._actions: Any = None
            self._seed: int | None = None

        def reset(self) -> np.ndarray:
            seed, self._seed = self._seed, None
            return self.vec.reset(seed=seed)[0]

        def seed(self, seed: int | None = None) -> list[int | None]:
            self._seed = seed
            return [seed] * self.num_envs

        def step_async(self, actions: np.ndarray) -> None:
            self._actions = actions

        def step_wait(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict]]:
            obs, reward, term, trunc, info = self.vec.step(self._actions)
            done = term | trunc
            infos: list[dict] = [{} for _ in range(self.num_envs)]
            for i in np.flatnonzero(done):
                infos[i] = {"terminal_observation": info["final_obs"][i], "TimeLimit.truncated": bool(trunc[i] and not term[i])}
            return obs, reward, done, infos

        def close(self) -> None:
            self.vec.close()

        def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
            return [getattr(self.vec.env, attr_name)] * len(self._get_indices(indices))

        def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
            setattr(self.vec.env, attr_name, value)

        def env_method(self, method_name: str, *args: Any, indices: Any = None, **kwargs: Any) -> list[Any]:
            return [getattr(self.vec.env, method_name)(*args, **kwargs)] * len(self._get_indices(indices))

        def env_is_wrapped(self, wrapper_class: type, indices: Any = None) -> list[bool]:
            return [False] * len(self._get_indices(indices))

    _CLASSES["sb3"] = PhalanxSB3VecEnv
    return PhalanxSB3VecEnv
