"""A tiny two-sided game for league tests, registered as `test_rps` when imported.

Rock-paper-scissors over `rounds` rounds: slot 0 and slot 1 pick Discrete(3); each sees the
other's previous move (one-hot) and the round fraction. Reward +1 / -1 per round won / lost;
the match ends (terminated) after `rounds` rounds; info `win` / `draw` [N, 2] at the end.
Scripted: `rock` (always 0), `paper` (always 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.envs.base import StepRecord, VecEnv, generator_state, set_generator_state
from phalanx.envs.registry import EnvOption, EnvSpec, register
from phalanx.envs.spaces import Box, Discrete


class RPSEnv(VecEnv):
    name = "test_rps"
    num_agents = 2
    scripted_names = ("rock", "paper")

    def __init__(self, num_envs: int = 1, device="cpu", seed: int | None = 0, rounds: int = 3):
        self.num_envs, self.device, self.rounds = num_envs, torch.device(device), rounds
        self.observation_space = Box.uniform(0.0, 1.0, (4,))
        self.action_space = Discrete(3)
        self.roles = self.default_roles()
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed or 0)
        self.t = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.last = torch.zeros(num_envs, 2, dtype=torch.long, device=self.device)
        self.score = torch.zeros(num_envs, 2, device=self.device)

    def _obs(self) -> torch.Tensor:
        seen = F.one_hot(self.last.flip(-1), 3).float()
        frac = (self.t.float() / self.rounds)[:, None, None].expand(self.num_envs, 2, 1)
        return torch.cat([seen, frac], -1)

    def _record(self, reward, done, info, final_obs=None) -> StepRecord:
        n = self.num_envs
        obs = self._obs()
        return StepRecord(obs, reward, done[:, None].expand(n, 2).clone(), torch.zeros(n, 2, dtype=torch.bool, device=self.device),
                          torch.ones(n, 2, dtype=torch.bool, device=self.device), torch.zeros(n, 2, dtype=torch.bool, device=self.device),
                          obs if final_obs is None else final_obs, info=info)

    def reset(self, seed: int | None = None) -> StepRecord:
        if seed is not None:
            self.gen.manual_seed(seed)
        self.t.zero_()
        self.last.zero_()
        self.score.zero_()
        z = torch.zeros(self.num_envs, 2, device=self.device)
        return self._record(z, torch.zeros(self.num_envs, dtype=torch.bool, device=self.device), {"win": z, "draw": z})

    def step(self, actions: torch.Tensor) -> StepRecord:
        a = actions.reshape(self.num_envs, 2).long()
        beats = (a[:, 0] - a[:, 1]).remainder(3)  # 1: slot 0 wins the round, 2: slot 1 wins
        r0 = (beats == 1).float() - (beats == 2).float()
        reward = torch.stack([r0, -r0], -1)
        self.score += reward
        self.last = a
        self.t += 1
        done = self.t >= self.rounds
        final = self._obs()
        diff = self.score[:, 0] - self.score[:, 1]
        win = torch.stack([diff > 0, diff < 0], -1).float()
        draw = (diff == 0).float()[:, None].expand(self.num_envs, 2)
        info = {"win": win, "draw": draw.clone()}
        self.t.masked_fill_(done, 0)
        self.last.masked_fill_(done[:, None], 0)
        self.score.masked_fill_(done[:, None], 0.0)
        return self._record(reward, done, info, final_obs=final)

    def scripted_actions(self, name, record, generator):
        if name not in self.scripted_names:
            raise KeyError(name)
        return torch.full((self.num_envs, 2), self.scripted_names.index(name), dtype=torch.long, device=self.device)

    def state_dict(self):
        return {"t": self.t.clone(), "last": self.last.clone(), "score": self.score.clone(), "rng": generator_state(self.gen)}

    def load_state_dict(self, state):
        self.t, self.last, self.score = (state[k].to(self.device).clone() for k in ("t", "last", "score"))
        set_generator_state(self.gen, state["rng"])


register(EnvSpec(name="test_rps", factory=RPSEnv, description="rock-paper-scissors for league tests",
                 options={"rounds": EnvOption(3, "rounds per match")}))
