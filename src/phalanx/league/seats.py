"""Both seats for the learner: `SwappedSides` hands the learner the first side of a two-sided env in half of
its episodes and the second side in the other half, so a league trains it as first and as second player.

The trainer and the league keep one fixed layout (the learner's side first, the opponent's on the last
`num_agents // 2` slots, league.py); the wrapper maps that layout onto the env's own slots per env copy,
swapping the two sides where `swapped` holds, and flips `swapped` where a copy's episode ends, so each copy
alternates seats game after game (odd copies start in the second seat). A turn-based game's first mover is the
env's first side; who moves first is part of the game, and a learner that only ever moved first would meet a
second-seat game for the first time in evaluation.

`info["seat"]` ([N, A] float) says which side of the env each slot played in the episode the record's
rewards and ends belong to: 0 the first side, 1 the second (the league counts games and rates the learner
per seat from it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from phalanx.draws import Source
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.errors import ConfigError

SEAT_KEY = "seat"
SEAT_NAMES = ("first", "second")


def wants_swapped_sides(seats: str, env: VecEnv) -> bool:
    """Whether config key `seats` (auto | first | both) swaps the sides of `env` in a league: auto does where the
    env is turn-based and its two sides are alike (same size and roles), both insists, first never does."""
    if seats == "first":
        return False
    why = _unlike_sides(env)
    if seats == "both" and why:
        raise ConfigError(f"config key 'seats' is 'both' but env '{env.name}' {why}; allowed for it: first, auto")
    return seats == "both" or (env.turn_based and not why)


def _unlike_sides(env: VecEnv) -> str:
    """Why the env's two sides cannot trade places ('' where they can)."""
    A = env.num_agents
    if A < 2 or A % 2:
        return f"has {A} agent slot(s), not two sides of the same size"
    roles = env.roles.tolist()
    if roles[: A // 2] != roles[A // 2:]:
        return f"gives its two sides different roles ({', '.join(env.role_names[r] for r in roles)})"
    return ""


class SwappedSides(VecEnv):
    """`env` with its two sides swapped in the copies where `swapped` holds (see the module docstring).

    Every per-slot tensor of a record is put in the learner's layout: the next observation, `active` and the
    action mask by the copy's new seating (a finished episode's copy starts the next one in the other seat),
    the step's rewards, flags, final observations and per-slot info by the seating the step was played in.
    Actions are taken in the learner's layout and handed to `env` in its own."""

    def __init__(self, env: VecEnv):
        if _unlike_sides(env):
            raise ConfigError(f"config key 'seats': env '{env.name}' {_unlike_sides(env)}")
        self.env = env
        for attr in ("name", "num_envs", "num_agents", "device", "observation_space", "action_space", "state_space",
                     "role_names", "roles", "success_key", "scripted_names", "capturable", "rng", "restorable", "renders",
                     "frame_stack", "action_masks", "turn_based", "agent_names", "mirror_actions", "has_afterstates", "afterstate_fn",
                     "has_move_outcomes", "move_outcome_fn"):
            setattr(self, attr, getattr(env, attr))
        N, A = env.num_envs, env.num_agents
        # Slot k of the learner's layout is the env's slot other[k] in a swapped copy (an involution).
        self.other = (torch.arange(A, device=env.device) + A // 2) % A
        self.swapped = self._first_seating()
        # The slots active on the record last returned (learner's layout): where all are done or idle, the episode ended.
        self.active = torch.ones(N, A, dtype=torch.bool, device=env.device)
        self.env_record: StepRecord | None = None  # the env's own last record, for its scripted policies

    def _first_seating(self) -> torch.Tensor:
        return torch.arange(self.num_envs, device=self.device) % 2 == 1

    def order(self, x: torch.Tensor, swapped: torch.Tensor) -> torch.Tensor:
        """[N, A, ...] between the two layouts (the swap is its own inverse)."""
        lead = swapped.reshape(-1, *([1] * (x.dim() - 1)))
        return torch.where(lead, x.index_select(1, self.other), x)

    def _per_slot(self, x: torch.Tensor) -> bool:
        return x.dim() >= 2 and x.shape[1] == self.num_agents

    def _record(self, rec: StepRecord, played: torch.Tensor, now: torch.Tensor) -> StepRecord:
        """`rec` in the learner's layout: what the step produced by `played`'s seating, what comes next by `now`'s."""
        seat = (self.order(torch.arange(self.num_agents, device=self.device).expand(self.num_envs, -1), played)
                >= self.num_agents // 2).float()
        info = {k: self.order(v, played) if self._per_slot(v) else v for k, v in rec.info.items()}
        info[SEAT_KEY] = seat
        out = dataclasses.replace(
            rec, obs=self.order(rec.obs, now), active=self.order(rec.active, now),
            action_mask=None if rec.action_mask is None else self.order(rec.action_mask, now),
            reward=self.order(rec.reward, played), terminated=self.order(rec.terminated, played),
            truncated=self.order(rec.truncated, played), trial_end=self.order(rec.trial_end, played),
            final_obs=self.order(rec.final_obs, played), info=info)
        self.env_record, self.active = rec, out.active
        return out

    def reset(self, seed: int | None = None) -> StepRecord:
        rec = self.env.reset(seed=seed)
        self.swapped = self._first_seating()
        return self._record(rec, self.swapped, self.swapped)

    def step(self, actions: torch.Tensor) -> StepRecord:
        played = self.swapped
        rec = self.env.step(self.order(actions, played))
        done = self.order(rec.terminated | rec.truncated, played)
        ended = (done | ~self.active).all(-1)
        self.swapped = played ^ ended
        return self._record(rec, played, self.swapped)

    def scripted_actions(self, name: str, record: StepRecord, draws: Source) -> torch.Tensor:
        """The env's scripted policy on its own record, its actions put in the learner's layout."""
        return self.order(self.env.scripted_actions(name, self.env_record or record, draws), self.swapped)

    def scripted_actions_in(self, name: str, record: StepRecord, draws: Source, rows: torch.Tensor) -> torch.Tensor:
        return self.order(self.env.scripted_actions_in(name, self.env_record or record, draws, rows), self.swapped)

    def turn_observations(self) -> list[tuple[int, Any]] | None:
        """As the env's (per copy, the slot to move and its observation as the game gave it), with the slot in the
        learner's layout."""
        turns = self.env.turn_observations()
        if turns is None:
            return None
        swapped, other = self.swapped.tolist(), self.other.tolist()
        return [(other[slot] if s else slot, obs) for (slot, obs), s in zip(turns, swapped)]

    def seats(self) -> Iterator[str]:
        """Each copy's seat for the learner's side in its current episode (first or second)."""
        return (SEAT_NAMES[int(s)] for s in self.swapped.tolist())

    def step_state(self) -> dict[str, torch.Tensor]:
        return {**{f"env.{k}": v for k, v in self.env.step_state().items()}, "swapped": self.swapped, "active": self.active}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.env.load_step_state({k[4:]: v for k, v in state.items() if k.startswith("env.")})
        self.swapped, self.active = state["swapped"], state["active"]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**{f"env.{k}": v for k, v in self.env.state_dict().items()},
                "swapped": self.swapped.clone(), "active": self.active.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.env.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("env.")})
        if "swapped" in state:
            self.swapped = state["swapped"].to(self.device, torch.bool).reshape(self.num_envs).clone()
            self.active = state["active"].to(self.device, torch.bool).reshape(self.num_envs, self.num_agents).clone()

    def render(self, env_index: int = 0) -> torch.Tensor:
        return self.env.render(env_index)

    def ended_frame(self, env_index: int = 0) -> torch.Tensor | None:
        return self.env.ended_frame(env_index)

    def close(self) -> None:
        self.env.close()
