"""Slot control: which agent slots learn, and the one way other controllers act in the rest.

A controller (`Player`) is a trained policy, a scripted policy's name or random play; `play` gives its
actions for every slot and `fill_slots` puts them into the slots it controls. Teammates (config key
`teammates`: scripted names or `run:RUN_DIR` frozen policies for the last slots), league opponents (the
last `num_agents // 2` slots) and evaluation against scripted teams and opponents all act through them.
"""

from __future__ import annotations

import torch

from phalanx.checkpoint import section
from phalanx.draws import Source
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.errors import ConfigError
from phalanx.policy import Policy, load

Player = Policy | str | None  # a trained policy, a scripted policy's name, or random play (None or "random")


def play(player: Player, env: VecEnv, rec: StepRecord, draws: Source, reset: torch.Tensor | None, greedy: bool) -> torch.Tensor:
    """Actions for every slot from a `Policy` (its memory reset where `reset` [N, A] marks an episode start),
    a scripted name, or random play (None or "random")."""
    if player is None or player == "random":
        return random_actions(env, draws)
    if isinstance(player, str):
        return env.scripted_actions(player, rec, draws)
    return player.act(rec.obs, greedy=greedy, generator=draws, reset=reset, active=rec.active)


def random_actions(env: VecEnv, draws: Source) -> torch.Tensor:
    """Uniform random actions for every slot of a batched env."""
    return env.action_space.sample(env.num_envs, env.num_agents, draws, env.device)


def fill_slots(actions: torch.Tensor, where: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`actions` [N, A, *act] with `other` in the slots where `where` holds: [A] (every env) or
    [N, A] (per env)."""
    lead = where.reshape(1, -1) if where.dim() == 1 else where
    m = lead.reshape(*lead.shape, *([1] * (actions.dim() - 2)))
    return torch.where(m, other.to(actions.dtype), actions)


def opponent_slots(num_agents: int, device: torch.device | str) -> torch.Tensor:
    """[A] bool: the opponent's side in two-sided play (the last A // 2 slots)."""
    if num_agents < 2:
        raise ConfigError("config key 'opponents' needs an env with at least 2 agent slots (one per side)")
    return torch.arange(num_agents, device=device) >= num_agents - num_agents // 2


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
        self.groups: list[tuple[str, torch.Tensor, Policy | None]] = []
        for name in dict.fromkeys(s for s in slots if s):
            mask = torch.tensor([s == name for s in slots], device=device)
            frozen = load(name[4:], device=str(device)) if name.startswith("run:") else None
            self.groups.append((name, mask, frozen))

    def step_state(self) -> dict[str, torch.Tensor]:
        """The frozen teammates' memories, as a step state (phalanx.graphs)."""
        return {f"{name}.{k}": v for name, _, frozen in self.groups if frozen is not None
                for k, v in frozen.step_state().items()}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, _, frozen in self.groups:
            if frozen is not None:
                frozen.load_step_state(section(state, name))

    def fill(self, actions: torch.Tensor, record: StepRecord, draws: Source, reset: torch.Tensor) -> torch.Tensor:
        """`actions` with the teammates' in their slots; `reset` [N, A]: the slots whose episode starts at this
        step (a frozen policy with memory resets it there)."""
        for name, mask, frozen in self.groups:
            actions = fill_slots(actions, mask, play(frozen or name, self.env, record, draws, reset, greedy=False))
        return actions
