"""A tiny PettingZoo ParallelEnv for the `pz:` import adapter tests (`pz:pz_tiny:make_env`).

Three agents (worker_0, worker_1, leader_0) see obs [target, t / max_cycles, agent index / 3] and
earn 1 when their Discrete(2) action equals `target` (a fresh random bit per agent per step).
worker_1 terminates at step `leave_step` and leaves; the others are truncated at `max_cycles`.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv


class TinyParallelEnv(ParallelEnv):
    metadata = {"name": "pz_tiny_v0", "render_modes": []}

    def __init__(self, max_cycles: int = 8, leave_step: int = 3, reward_scale: float = 1.0) -> None:
        self.possible_agents = ["worker_0", "worker_1", "leader_0"]
        self.agents: list[str] = []
        self.max_cycles = int(max_cycles)
        self.leave_step = int(leave_step)
        self.reward_scale = float(reward_scale)
        self._rng = np.random.default_rng()
        self._t = 0
        self._target: dict[str, int] = {}
        # One space object per agent, returned on every call (as PettingZoo asks).
        self.observation_spaces = {a: spaces.Box(0.0, 1.0, shape=(3,), dtype=np.float32) for a in self.possible_agents}
        self.action_spaces = {a: spaces.Discrete(self._num_actions(a)) for a in self.possible_agents}

    def _num_actions(self, agent: str) -> int:
        return 2

    def observation_space(self, agent: str) -> spaces.Box:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> spaces.Discrete:
        return self.action_spaces[agent]

    def _obs(self, agent: str) -> np.ndarray:
        idx = self.possible_agents.index(agent)
        return np.array([self._target[agent], self._t / self.max_cycles, idx / 3], dtype=np.float32)

    def _draw(self) -> None:
        self._target = {a: int(self._rng.integers(2)) for a in self.agents}

    def reset(self, seed=None, options=None):
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self._t = 0
        self._draw()
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        rewards = {a: self.reward_scale * float(int(actions[a]) == self._target[a]) for a in self.agents}
        self._t += 1
        acting = list(self.agents)
        terminations = {a: a == "worker_1" and self._t >= self.leave_step for a in acting}
        truncations = {a: self._t >= self.max_cycles and not terminations[a] for a in acting}
        self._target = {a: int(self._rng.integers(2)) for a in acting}
        observations = {a: self._obs(a) for a in acting}
        infos = {a: {} for a in acting}
        self.agents = [a for a in acting if not (terminations[a] or truncations[a])]
        return observations, rewards, terminations, truncations, infos


def make_env(**options) -> TinyParallelEnv:
    return TinyParallelEnv(**options)


class MixedSpacesEnv(TinyParallelEnv):
    """leader_0 has three actions, the workers two: the adapter masks the workers' third."""

    def _num_actions(self, agent: str) -> int:
        return 3 if agent == "leader_0" else 2


def make_mixed(**options) -> MixedSpacesEnv:
    return MixedSpacesEnv(**options)


class BoxLeaderEnv(TinyParallelEnv):
    """leader_0 acts with a Box while the workers pick from a Discrete: the adapter must refuse it."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.action_spaces["leader_0"] = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)


def make_box_leader(**options) -> BoxLeaderEnv:
    return BoxLeaderEnv(**options)
