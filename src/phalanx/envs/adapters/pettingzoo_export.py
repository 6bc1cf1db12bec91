"""One environment of a phalanx batch as a PettingZoo `ParallelEnv` (`to_pettingzoo`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phalanx.envs.adapters.gym import gym_space_of
from phalanx.envs.adapters.pettingzoo_parallel import _require_pettingzoo
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.spaces import Discrete, MultiDiscrete
from phalanx.errors import ConfigError


def _agent_names(env: VecEnv) -> list[str]:
    """`f"{role_name}_{i}"`, with i counting the slots of each role (e.g. sensor_0, sensor_1, relay_0)."""
    roles = getattr(env, "roles", None)
    names = tuple(getattr(env, "role_names", ("agent",))) or ("agent",)
    role_idx = [0] * env.num_agents if roles is None else [int(r) for r in torch.as_tensor(roles).reshape(-1).tolist()]
    counts: dict[str, int] = {}
    out = []
    for r in role_idx:
        role = names[r] if 0 <= r < len(names) else f"role{r}"
        out.append(f"{role}_{counts.get(role, 0)}")
        counts[role] = counts.get(role, 0) + 1
    return out


def to_pettingzoo(env: VecEnv, index: int = 0) -> Any:
    """Environment `index` of the phalanx batch `env` as a PettingZoo `ParallelEnv`.

    Agents are named `f"{role_name}_{i}"` (i counts the slots of each role). `agents` holds the
    slots that are active and have not finished this episode. Other environments of the batch are
    stepped with action 0 (use `num_envs=1` to avoid the waste). See `PhalanxParallelEnv`.
    """
    _require_pettingzoo("to_pettingzoo")
    if not 0 <= index < env.num_envs:
        raise ConfigError(f"index {index} out of range for an env batch of {env.num_envs}")
    return _parallel_env_class()(env, index)


_PARALLEL_CLASS: type | None = None


def _parallel_env_class() -> type:
    """Build the ParallelEnv subclass on first use, so pettingzoo stays an optional import."""
    global _PARALLEL_CLASS
    if _PARALLEL_CLASS is not None:
        return _PARALLEL_CLASS
    from pettingzoo import ParallelEnv

    class PhalanxParallelEnv(ParallelEnv):
        """One env of a phalanx batch with PettingZoo's parallel API (numpy values, per-agent dicts).

        Boundary mapping: `step` returns values for the agents that acted (those in `agents`
        before the step). A slot flagged `terminated`/`truncated`, or one that went inactive
        without a flag (reported as terminated), leaves `agents` and is not re-added in this
        episode, even if the phalanx env revives it (it is then stepped with action 0). When every
        agent is gone, `agents` is empty and the returned observations are the phalanx `final_obs`
        (the auto-reset stays hidden); call `reset()` to start the next episode, which resets the
        whole phalanx batch with the given seed. A `trial_end` appears as `infos[agent]["trial_end"]`;
        the env's `info` values are copied into every agent's infos on the step the episode ends.
        """

        metadata = {"name": "phalanx", "render_modes": [], "is_parallelizable": True}

        def __init__(self, venv: VecEnv, index: int) -> None:
            self.venv = venv
            self.index = index
            self.metadata = {"name": f"phalanx_{venv.name}", "render_modes": [], "is_parallelizable": True}
            self.possible_agents = _agent_names(venv)
            self._slot = {a: i for i, a in enumerate(self.possible_agents)}
            obs_space = gym_space_of(venv.observation_space)
            act_space = gym_space_of(venv.action_space)
            # The same object per agent, every call (parallel_api_test checks identity).
            self.observation_spaces = {a: obs_space for a in self.possible_agents}
            self.action_spaces = {a: act_space for a in self.possible_agents}
            self.state_space = None if venv.state_space is None else gym_space_of(venv.state_space)
            self.agents: list[str] = []
            self._finished: set[str] = set()
            self._record: StepRecord | None = None
            self._state: np.ndarray | None = None
            self._act_space = venv.action_space

        def observation_space(self, agent: str) -> Any:
            return self.observation_spaces[agent]

        def action_space(self, agent: str) -> Any:
            return self.action_spaces[agent]

        def _np(self, t: torch.Tensor) -> np.ndarray:
            return t[self.index].detach().cpu().numpy()

        def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
            rec = self.venv.reset(seed=seed)
            self._record = rec
            self._finished = set()
            obs = self._np(rec.obs)
            active = self._np(rec.active)
            self.agents = [a for a in self.possible_agents if active[self._slot[a]]]
            self._state = None if rec.state is None else self._np(rec.state)
            return {a: obs[self._slot[a]].copy() for a in self.agents}, {a: {} for a in self.agents}

        def _actions_tensor(self, actions: dict[str, Any]) -> torch.Tensor:
            n, a_count, dev = self.venv.num_envs, self.venv.num_agents, self.venv.device
            space = self._act_space
            if isinstance(space, Discrete):
                out = torch.zeros(n, a_count, dtype=torch.long, device=dev)
            elif isinstance(space, MultiDiscrete):
                out = torch.zeros(n, a_count, len(space.nvec), dtype=torch.long, device=dev)
            else:
                low, high = space.low_tensor(dev), space.high_tensor(dev)
                # Default action: 0 clipped into the box (finite bounds only).
                default = torch.zeros(space.shape, device=dev)
                default = torch.where(torch.isfinite(low), torch.maximum(default, low), default)
                default = torch.where(torch.isfinite(high), torch.minimum(default, high), default)
                out = default.expand(n, a_count, *space.shape).clone()
            dtype = out.dtype
            for agent, act in actions.items():
                if agent not in self._slot:
                    raise KeyError(f"unknown agent {agent!r}; possible agents: {self.possible_agents}")
                if agent not in self.agents:
                    continue  # PettingZoo lets callers pass actions of finished agents; ignore them
                out[self.index, self._slot[agent]] = torch.as_tensor(np.asarray(act), dtype=dtype, device=dev).reshape(out.shape[2:])
            return out

        def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
            if self._record is None or not self.agents:
                raise RuntimeError("step() called with no live agents; call reset() first")
            missing = [a for a in self.agents if a not in actions]
            if missing:
                raise KeyError(f"no action for live agents {missing}")
            acting = list(self.agents)
            rec = self.venv.step(self._actions_tensor(actions))
            self._record = rec
            i = self.index
            reward = self._np(rec.reward)
            term = self._np(rec.terminated)
            trunc = self._np(rec.truncated)
            active = self._np(rec.active)
            trial_end = self._np(rec.trial_end)
            obs_np, final_np = self._np(rec.obs), self._np(rec.final_obs)
            terminations, truncations = {}, {}
            for a in acting:
                s = self._slot[a]
                terminations[a] = bool(term[s]) or not (bool(trunc[s]) or bool(active[s]))
                truncations[a] = bool(trunc[s])
            # The env's episode ended: every acting slot is done (others were already inactive).
            episode_end = all(terminations[a] or truncations[a] for a in acting)
            self._finished |= {a for a in acting if terminations[a] or truncations[a]}
            if episode_end:
                self.agents = []
                observations = {a: final_np[self._slot[a]].copy() for a in acting}
                if rec.final_state is not None:
                    self._state = self._np(rec.final_state)
            else:
                self.agents = [a for a in self.possible_agents if active[self._slot[a]] and a not in self._finished]
                # Slots that just ended report their last observation (final_obs), others the new one.
                observations = {
                    a: (final_np if (terminations[a] or truncations[a]) else obs_np)[self._slot[a]].copy()
                    for a in sorted(set(acting) | set(self.agents), key=self._slot.get)
                }
                if rec.state is not None:
                    self._state = self._np(rec.state)
            infos: dict[str, dict[str, Any]] = {a: {} for a in observations}
            for a in observations:
                if trial_end[self._slot[a]]:
                    infos[a]["trial_end"] = True
            if episode_end and rec.info:
                for a in acting:
                    s = self._slot[a]
                    for k, v in rec.info.items():
                        v = v[i]
                        if v.ndim >= 1 and v.shape[0] == self.venv.num_agents:
                            v = v[s]
                        infos[a][k] = v.item() if v.numel() == 1 else v.detach().cpu().numpy()
            rewards = {a: float(reward[self._slot[a]]) if a in acting else 0.0 for a in observations}
            for a in observations:
                terminations.setdefault(a, False)
                truncations.setdefault(a, False)
            return observations, rewards, terminations, truncations, infos

        def state(self) -> np.ndarray:
            if self._state is None:
                raise NotImplementedError(f"phalanx env '{self.venv.name}' has no global state")
            return self._state.copy()

        def close(self) -> None:
            self.venv.close()

    PhalanxParallelEnv.__qualname__ = "PhalanxParallelEnv"
    _PARALLEL_CLASS = PhalanxParallelEnv
    return PhalanxParallelEnv


# --------------------------------------------------------------------------------------------------
# Import: a PettingZoo ParallelEnv factory as a phalanx VecEnv
# --------------------------------------------------------------------------------------------------
