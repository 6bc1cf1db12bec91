"""Running returns and lengths of the episodes in play, shared by training and evaluation."""

from __future__ import annotations

import torch


class EpisodeCounters:
    """Per slot [N, A] and per env [N] (the team: every active slot's reward) counters, on the device.

    An env's episode has ended (`step` returns it) where every slot is done or was already inactive.
    """

    def __init__(self, num_envs: int, num_agents: int, device: torch.device | str):
        self.slot_return = torch.zeros(num_envs, num_agents, device=device)
        self.slot_length = torch.zeros(num_envs, num_agents, device=device)
        self.team_return = torch.zeros(num_envs, device=device)
        self.env_length = torch.zeros(num_envs, device=device)
        # Added as a tensor: a Python number is wrapped into a double tensor and cast at every add, which
        # on a CPU costs more than the add of a few numbers.
        self._one = torch.ones((), device=device)

    def step(self, reward: torch.Tensor, done: torch.Tensor, prev_active: torch.Tensor,
             idle_rewards: bool = False) -> torch.Tensor:
        """Add one step's rewards (of the slots that acted; every slot's with `idle_rewards`, see `add`);
        -> [N] bool: the env's episode ended."""
        self.add(reward, prev_active, idle_rewards)
        return env_ended(done, prev_active)

    def add(self, reward: torch.Tensor, prev_active: torch.Tensor | None, idle_rewards: bool = False) -> None:
        """Add one step's rewards and lengths (of the slots that acted; None: every slot did). `idle_rewards`
        (a turn-based env): the rewards of the slots that sat out count too, their lengths do not."""
        if prev_active is None:  # no bool-to-float mask, which at a few envs on a CPU is most of the cost
            self.slot_return += reward
            self.slot_length += self._one
            self.team_return += reward.sum(-1)
        elif idle_rewards:
            self.slot_return += reward
            self.slot_length += prev_active
            self.team_return += reward.sum(-1)
        else:
            earned = reward * prev_active
            self.slot_return += earned
            self.slot_length += prev_active
            self.team_return += earned.sum(-1)
        self.env_length += self._one

    def end_slots(self, done: torch.Tensor) -> None:
        self.slot_return.masked_fill_(done, 0.0)
        self.slot_length.masked_fill_(done, 0.0)

    def end_envs(self, env_done: torch.Tensor) -> None:
        self.team_return.masked_fill_(env_done, 0.0)
        self.env_length.masked_fill_(env_done, 0.0)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        # Names kept from the first checkpoint format, so older runs resume.
        return {"ep_return": self.slot_return, "ep_length": self.slot_length, "team_return": self.team_return,
                "env_length": self.env_length}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        dev = self.team_return.device
        self.slot_return = tensors["ep_return"].to(dev)
        self.slot_length = tensors["ep_length"].to(dev)
        self.team_return = tensors["team_return"].to(dev)
        if "env_length" in tensors:
            self.env_length = tensors["env_length"].to(dev)


def env_ended(done: torch.Tensor, prev_active: torch.Tensor) -> torch.Tensor:
    """[N] bool: the env's episode ended at this step (every slot done or already inactive)."""
    return (done | ~prev_active).all(-1)


def stack_restarts(done: torch.Tensor, trial_end: torch.Tensor, prev_active: torch.Tensor) -> torch.Tensor:
    """[N, A] bool: where a frame-stacked observation (VecEnv.frame_stack) starts afresh after this step: the
    slot's episode or trial ended, or its env's episode did."""
    return done | trial_end | env_ended(done, prev_active).unsqueeze(-1)


def frame_rows(restarts: torch.Tensor, stack: int) -> torch.Tensor:
    """The frames each stored observation is made of, for a rollout that keeps each frame once: frames row
    r (of T + stack - 1) holds, for r >= stack - 1, the newest frame of step r - stack + 1's observation, and
    rows 0..stack-2 the older frames of step 0's. `restarts` [T, N, A] (stack_restarts after each step) ->
    rows [T, N, A, stack], oldest first: step t's frame j is row t + j, but never one before the newest
    frame of the observation its stack started from (that start's copies)."""
    T = restarts.shape[0]
    t = torch.arange(T, device=restarts.device).view(T, *[1] * (restarts.dim() - 1))
    fresh = torch.zeros_like(restarts)
    fresh[1:] = restarts[:-1]  # the observation of step t starts afresh where step t - 1 ended its stack
    start = torch.where(fresh, t + stack - 1, 0).cummax(0).values
    return torch.maximum(t.unsqueeze(-1) + torch.arange(stack, device=restarts.device), start.unsqueeze(-1))


def frame_index(frames: torch.Tensor, restarts: torch.Tensor) -> torch.Tensor:
    """[T, N, A, S] indices into `frames.flatten(0, 2)` ([T + S - 1, N, A, *frame] as the rollout stores them)
    of the frames of every stored observation, oldest first (`frame_rows`)."""
    T, N, A = restarts.shape
    rows = frame_rows(restarts, frames.shape[0] - T + 1)
    env = torch.arange(N, device=rows.device).view(1, N, 1, 1)
    slot = torch.arange(A, device=rows.device).view(1, 1, A, 1)
    return (rows * N + env) * A + slot
