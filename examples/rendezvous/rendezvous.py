"""rendezvous: a complete multi-agent Phalanx env written only against the public API.

Two walkers on a ring of `size` cells must meet. Each step every walker moves left, stays or moves
right (Discrete(3)). Each sees its own position and the other's offset (both scaled to [-1, 1]); the
global state (for `--critic mappo`) holds both positions. They meet when at most one cell apart, which
ends the episode (`terminated`) and pays each 1; a step costs each 0.05; `max_steps` cuts the episode
(`truncated`). Random starts are drawn through `self.rng`, so `--compile` captures the whole rollout
step. Train it from this directory, without installing anything:

    phalanx train --env rendezvous:make --total-steps 100000
    phalanx train --env rendezvous:spec --size 15        # the EnvSpec form: declared options, defaults
    phalanx check-env rendezvous:make
"""

from __future__ import annotations

import torch

from phalanx.draws import Draws
from phalanx.envs import Box, Discrete, EnvOption, EnvSpec, StepRecord, VecEnv


class Rendezvous(VecEnv):
    name = "rendezvous"
    num_agents = 2
    role_names = ("walker",)
    action_space = Discrete(3)
    observation_space = Box.uniform(-1.0, 1.0, (2,))
    state_space = Box.uniform(0.0, 1.0, (2,))
    capturable = True

    def __init__(self, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0,
                 size: int = 11, max_steps: int = 40):
        if size < 5:
            raise ValueError(f"size must be >= 5, got {size}")
        self.num_envs, self.device = num_envs, torch.device(device)
        self.size, self.max_steps = size, max_steps
        self.roles = torch.zeros(self.num_agents, dtype=torch.long, device=self.device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(0 if seed is None else seed)
        self.rng = Draws(self.gen)
        self.pos = torch.zeros(num_envs, self.num_agents, dtype=torch.long, device=self.device)
        self.elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)

    # --- what the agents see --------------------------------------------------------------------
    def _obs(self, pos: torch.Tensor) -> torch.Tensor:
        half = self.size // 2
        offset = (pos.flip(-1) - pos + half) % self.size - half  # the other walker, the short way round
        return torch.stack([pos.float() / (self.size - 1) * 2 - 1, offset.float() / half], -1)

    def _state(self, pos: torch.Tensor) -> torch.Tensor:
        return pos.float() / (self.size - 1)

    def _starts(self) -> torch.Tensor:
        # Apart: the second walker starts 2..size-2 cells to the right of the first.
        first = self.rng.randint(0, self.size, (self.num_envs,), self.device)
        gap = self.rng.randint(2, self.size - 1, (self.num_envs,), self.device)
        return torch.stack([first, (first + gap) % self.size], -1)

    def _record(self, reward, terminated, truncated, final_obs, final_state, info) -> StepRecord:
        n, a = self.num_envs, self.num_agents
        return StepRecord(
            obs=self._obs(self.pos), reward=reward, terminated=terminated, truncated=truncated,
            active=torch.ones(n, a, dtype=torch.bool, device=self.device),
            trial_end=torch.zeros(n, a, dtype=torch.bool, device=self.device),
            final_obs=final_obs, state=self._state(self.pos), final_state=final_state, info=info,
        )

    # --- the protocol ---------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> StepRecord:
        if seed is not None:
            self.gen.manual_seed(seed)
        self.pos = self._starts()
        self.elapsed.zero_()
        zeros = torch.zeros(self.num_envs, self.num_agents, device=self.device)
        done = zeros.bool()
        return self._record(zeros, done, done, self._obs(self.pos), self._state(self.pos), {})

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        pos = (self.pos + actions.reshape(self.num_envs, self.num_agents) - 1) % self.size
        self.elapsed += 1
        apart = (pos[:, 0] - pos[:, 1]) % self.size
        met = torch.minimum(apart, self.size - apart) <= 1
        timeout = (self.elapsed >= self.max_steps) & ~met
        reward = torch.where(met, 1.0, -0.05).unsqueeze(1).expand(-1, self.num_agents).contiguous()
        final_obs, final_state = self._obs(pos), self._state(pos)
        done = met | timeout
        starts = self._starts()
        self.pos = torch.where(done.unsqueeze(1), starts, pos)
        self.elapsed = torch.where(done, 0, self.elapsed)
        per_slot = lambda x: x.unsqueeze(1).expand(-1, self.num_agents).contiguous()  # noqa: E731
        return self._record(reward, per_slot(met), per_slot(timeout), final_obs, final_state, {"met": met.float()})

    def step_state(self) -> dict[str, torch.Tensor]:
        # What a step reads and replaces; checkpoints save copies of it and the generator's state.
        return {"pos": self.pos, "elapsed": self.elapsed}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.pos, self.elapsed = state["pos"], state["elapsed"]


def make(num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0, size: int = 11,
         max_steps: int = 40) -> Rendezvous:
    """rendezvous: two walkers on a ring must meet (plugin factory: options from its signature)."""
    return Rendezvous(num_envs, device, seed, size=size, max_steps=max_steps)


spec = EnvSpec(
    name="rendezvous",
    factory=Rendezvous,
    description="two walkers on a ring must meet: Discrete(3) each, obs 2, global state 2",
    options={"size": EnvOption(11, "cells on the ring"), "max_steps": EnvOption(40, "time limit in steps (truncated)")},
    train_defaults={"total_steps": 100_000, "num_envs": 32, "num_steps": 32, "lr": 3e-3},
)
