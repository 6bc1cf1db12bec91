"""Generalized advantage estimation with the boundary semantics of docs/DESIGN.md section 2."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.algo.scan import linear_scan


@dataclass(frozen=True)
class GAEParams:
    """How advantages are estimated: the config keys of the same names, whose defaults and meanings config.py
    holds (`config.params_of` fills them)."""

    gamma: float
    gae_lambda: float
    trial_bootstrap: str  # across a trial end: continue (RL^2-style) or stop (cut like a termination)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    gae_lambda: float,
    active: torch.Tensor | None = None,
    trial_end: torch.Tensor | None = None,
    trial_bootstrap: str | None = None,
    active_after: torch.Tensor | None = None,
    idle_rewards: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and value targets, all tensors [T, ...].

    `next_values[t]` is V of the observation that followed step t *before* any auto-reset, i.e.
    V(final_obs_t): a truncation bootstraps from it, a termination ignores it. Inactive steps get
    zero advantage and leave the running estimate untouched, so value flows across them from
    the next active step, unless the step before the gap ended its episode: it keeps its own
    bootstrap. With `trial_end`, `trial_bootstrap` says what a trial end does (config key trial_bootstrap, its one
    default): "stop" cuts the trace like a termination; with "continue" value flows across it.

    `active_after [...]` says which slots act right after the rollout (None: all): a gap that runs to
    the rollout's end bootstraps from `next_values[-1]`, V of that next observation, where the slot
    acts there; where it does not, the step before the gap has no bootstrap yet (`pending_bootstrap`):
    its advantage is 0 (leave it out of the update) and the steps before it bootstrap from its value
    with the trace cut there, as at a rollout's end.

    `idle_rewards` (a turn-based env, VecEnv.turn_based): a reward that reaches a slot on a step it sat out (the
    opponent's winning move) belongs to its last action, as PettingZoo's `last()` has it: an active step whose
    episode goes on is credited with the rewards of the inactive steps that follow it, up to the slot's next
    active step or the step that ends its episode. Otherwise a reward on an inactive step is ignored (envs that
    are not turn-based give none there: check-env).
    """
    _check_trial_bootstrap(trial_end, trial_bootstrap)
    not_term = (~terminated).to(rewards.dtype)
    if trial_end is not None and trial_bootstrap == "stop":
        not_term = not_term * (~trial_end).to(rewards.dtype)
    ended = _ended(terminated, truncated, trial_end, trial_bootstrap)
    not_ended = (~ended).to(rewards.dtype)
    decay = gamma * gae_lambda * not_ended
    if active is None:
        deltas = rewards + gamma * next_values * not_term - values
        advantages = _backward_scan(decay, deltas)
        return advantages, advantages + values
    # An active step followed by inactive ones (a parked or not-yet-spawned slot) bootstraps from
    # the value of the slot's next active step, carried backwards across the gap, not from the value
    # of an observation it was inactive at. Going backwards, `carry` is the value of the latest active
    # step seen (or the bootstrap of an episode boundary flagged on an inactive step; beyond the rollout,
    # V of the observation after it where the slot acts there) and `known` says whether one was seen;
    # both, and the advantages, are linear recurrences, so each is one parallel scan over time (log2 T
    # batched ops, no per-step launches).
    act = active.to(rewards.dtype)
    if idle_rewards:
        idle = 1.0 - act
        late = _backward_scan(idle * not_ended, idle * rewards)  # the rewards of the idle run that starts at t
        rewards = rewards + act * not_ended * torch.cat([late[1:], torch.zeros_like(late[:1])], 0)
    after = torch.ones_like(act[0]) if active_after is None else active_after.to(rewards.dtype)
    ended_here = (1.0 - act) * (1.0 - not_ended)
    seen = act * values + ended_here * not_term * next_values
    beyond = after * next_values[-1]  # the carry beyond the last row: it passes an inactive last row
    seen = torch.cat([seen[:-1], seen[-1:] + (1.0 - act[-1:] - ended_here[-1:]) * beyond], 0)
    carry = _backward_scan(1.0 - act - ended_here, seen)
    known = _later_active_or_end(act, ended_here, after)
    later = lambda x, fill: torch.cat([x[1:], fill.unsqueeze(0)], 0)  # noqa: E731 x[t + 1]
    carry_next, act_next = later(carry, beyond), later(act, after)
    gap_value = known * carry_next + (1.0 - known) * next_values
    # Only a step whose episode goes on looks across the gap: one that ended keeps its own bootstrap
    # (V(final_obs), or none), since the carried value belongs to the next episode.
    across_gap = (1.0 - act_next) * not_ended
    nv = (1.0 - across_gap) * next_values + across_gap * gap_value
    deltas = rewards + gamma * nv * not_term - values
    # A step whose bootstrap lies beyond the rollout trains on nothing and cuts the trace before it.
    trained = act * (1.0 - not_ended * (1.0 - known))
    # An episode boundary flagged on an inactive step still cuts the trace.
    last = _backward_scan(trained * decay + (1.0 - act) * not_ended, trained * deltas)
    advantages = trained * last
    return advantages, advantages + values


def pending_bootstrap(
    active: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    active_after: torch.Tensor,
    trial_end: torch.Tensor | None = None,
    trial_bootstrap: str | None = None,
) -> torch.Tensor:
    """[T, ...] bool: the active steps whose bootstrap lies beyond the rollout: the episode goes on, and the
    slot acts at no later step of the rollout, nor right after it (`active_after`), and no episode end is
    flagged in between. `compute_gae` gives them advantage 0; the update leaves them out."""
    _check_trial_bootstrap(trial_end, trial_bootstrap)
    ended = _ended(terminated, truncated, trial_end, trial_bootstrap)
    act = active.float()
    ended_here = (1.0 - act) * ended.float()
    known = _later_active_or_end(act, ended_here, active_after.float())
    return active & ~ended & (known == 0)


def _check_trial_bootstrap(trial_end: torch.Tensor | None, trial_bootstrap: str | None) -> None:
    if trial_end is not None and trial_bootstrap not in ("continue", "stop"):
        raise ValueError(f"trial_bootstrap must be 'continue' or 'stop' where trial ends are given, got {trial_bootstrap!r}")


def _ended(terminated: torch.Tensor, truncated: torch.Tensor, trial_end: torch.Tensor | None,
           trial_bootstrap: str | None) -> torch.Tensor:
    ended = terminated | truncated
    return ended | trial_end if trial_end is not None and trial_bootstrap == "stop" else ended


def _later_active_or_end(act: torch.Tensor, ended_here: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """1 where a later step of the rollout is active or flags an episode end on an inactive one, or the
    slot acts right after the rollout (`after`): the value that follows across a gap is known."""
    rows = torch.cat([torch.maximum(act, ended_here), after.unsqueeze(0)], 0)
    return rows.flip(0).cummax(0).values.flip(0)[1:]


def _backward_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x_t = a_t * x_{t+1} + b_t over dim 0, from x_T = 0."""
    return linear_scan(a.flip(0), b.flip(0), 0)[1].flip(0)
