"""A tiny turn-based PettingZoo AEC game for the adapter's tests (`pz:pz_turns:make_env`).

Two players take stones from a pile in turn: taker_0 takes 1 to 3 (Discrete(3): action k takes k + 1),
taker_1 1 or 2 (Discrete(2)); the `action_mask` forbids taking more than the pile holds. Whoever takes
the last stone wins (+1, the other -1). Every move also pays: the mover -0.01, the other player +0.05
per stone taken, a reward that reaches it on the mover's turn. taker_0 sees [pile / 12, turns / 20],
taker_1 [pile / 12] (observation spaces differ). `truncate_at` cuts a game after that many moves.

`broken` makes it break a rule, for the bad-input tests: "selection" (agent_selection names no live agent
after the first move), "mask_shape" (the mask has one entry too many), "mask_dtype" (a float mask),
"mask_empty" (taker_1's mask allows nothing), "last" (last() returns four values).
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from pettingzoo import AECEnv

try:
    from pettingzoo.utils import AgentSelector
except ImportError:  # pettingzoo 1.24 names it agent_selector
    from pettingzoo.utils import agent_selector as AgentSelector

TAKES = {"taker_0": 3, "taker_1": 2}


class TakeTurnsEnv(AECEnv):
    metadata = {"name": "pz_turns_v0", "render_modes": [], "is_parallelizable": False}

    def __init__(self, truncate_at: int = 0, broken: str = "") -> None:
        super().__init__()
        self.possible_agents = ["taker_0", "taker_1"]
        self.truncate_at = int(truncate_at)
        self.broken = broken
        self.observation_spaces = {
            a: spaces.Dict({"observation": spaces.Box(0.0, 1.0, shape=(2 if a == "taker_0" else 1,), dtype=np.float32),
                            "action_mask": spaces.Box(0, 1, shape=(TAKES[a],), dtype=np.int8)})
            for a in self.possible_agents}
        self.action_spaces = {a: spaces.Discrete(TAKES[a]) for a in self.possible_agents}
        self.pile = 0
        self.turns = 0

    def observation_space(self, agent: str) -> spaces.Space:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> spaces.Space:
        return self.action_spaces[agent]

    def _mask(self, agent: str) -> np.ndarray:
        mask = np.zeros(TAKES[agent], dtype=np.int8)
        if agent == self.agent_selection and not (self.broken == "mask_empty" and agent == "taker_1"):
            mask[: min(TAKES[agent], self.pile)] = 1
        if self.broken == "mask_shape":
            return np.concatenate([mask, [1]]).astype(np.int8)
        if self.broken == "mask_dtype":
            return mask.astype(np.float32)
        return mask

    def observe(self, agent: str) -> dict[str, np.ndarray]:
        seen = [self.pile / 12, self.turns / 20] if agent == "taker_0" else [self.pile / 12]
        return {"observation": np.array(seen, dtype=np.float32), "action_mask": self._mask(agent)}

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        if seed is not None or not hasattr(self, "rng"):
            self.rng = np.random.default_rng(seed)
        self.pile = int(self.rng.integers(5, 13))
        self.turns = 0
        self.agents = list(self.possible_agents)
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self._cumulative_rewards = dict.fromkeys(self.agents, 0.0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.infos = {a: {} for a in self.agents}
        self._selector = AgentSelector(self.agents)
        self.agent_selection = self._selector.reset()

    def step(self, action: int | None) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        take = int(action) + 1
        assert 1 <= take <= min(TAKES[agent], self.pile), f"illegal move {action} of {agent} with {self.pile} left"
        other = next(a for a in self.agents if a != agent)
        self._cumulative_rewards[agent] = 0.0
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self.pile -= take
        self.turns += 1
        self.rewards[agent] -= 0.01
        self.rewards[other] += 0.05 * take
        if self.pile == 0:
            self.rewards[agent] += 1.0
            self.rewards[other] -= 1.0
            self.terminations = dict.fromkeys(self.agents, True)
        elif self.truncate_at and self.turns >= self.truncate_at:
            self.truncations = dict.fromkeys(self.agents, True)
        self._accumulate_rewards()
        self.agent_selection = self._selector.next()
        if self.broken == "selection":
            self.agent_selection = "nobody"

    def last(self, observe: bool = True):
        out = super().last(observe)
        return out[:4] if self.broken == "last" else out


def make_env(truncate_at: int = 0, broken: str = "") -> TakeTurnsEnv:
    return TakeTurnsEnv(truncate_at=truncate_at, broken=broken)
