"""Generalized advantage estimation with the boundary semantics of DESIGN.md section 2."""

from __future__ import annotations

import torch

from phalanx.algo.scan import linear_scan


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
    trial_bootstrap: str = "continue",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and value targets, all tensors [T, ...].

    `next_values[t]` is V of the observation that followed step t *before* any auto-reset, i.e.
    V(final_obs_t): a truncation bootstraps from it, a termination ignores it. Inactive steps get
    zero advantage and leave the running estimate untouched, so value flows across them from
    the next active step, unless the step before the gap ended its episode: it keeps its own
    bootstrap. With `trial_bootstrap="stop"` a trial end cuts the trace like a
    termination; with "continue" value flows across it.
    """
    if trial_bootstrap not in ("continue", "stop"):
        raise ValueError(f"trial_bootstrap must be 'continue' or 'stop', got {trial_bootstrap!r}")
    not_term = (~terminated).to(rewards.dtype)
    ended = terminated | truncated
    if trial_end is not None and trial_bootstrap == "stop":
        not_term = not_term * (~trial_end).to(rewards.dtype)
        ended = ended | trial_end
    not_ended = (~ended).to(rewards.dtype)
    decay = gamma * gae_lambda * not_ended
    if active is None:
        deltas = rewards + gamma * next_values * not_term - values
        advantages = _backward_scan(decay, deltas)
        return advantages, advantages + values
    # An active step followed by inactive ones (a parked or not-yet-spawned slot) bootstraps from
    # the value of the slot's next active step, carried backwards across the gap, not from the value
    # of an observation it was inactive at. Going backwards, `carry` is the value of the latest active
    # step seen (or the bootstrap of an episode boundary flagged on an inactive step) and `known`
    # says whether one was seen; both, and the advantages, are linear recurrences, so each is one
    # parallel scan over time (log2 T batched ops, no per-step launches).
    act = active.to(rewards.dtype)
    ended_here = (1.0 - act) * (1.0 - not_ended)
    carry = _backward_scan(1.0 - act - ended_here, act * values + ended_here * not_term * next_values)
    known = torch.maximum(act, ended_here).flip(0).cummax(0).values.flip(0)
    later = lambda x, fill: torch.cat([x[1:], torch.full_like(x[:1], fill)], 0)  # noqa: E731 x[t + 1]
    carry_next, known_next, act_next = later(carry, 0.0), later(known, 0.0), later(act, 1.0)
    gap_value = known_next * carry_next + (1.0 - known_next) * next_values
    # Only a step whose episode goes on looks across the gap: one that ended keeps its own bootstrap
    # (V(final_obs), or none), since the carried value belongs to the next episode.
    across_gap = (1.0 - act_next) * not_ended
    nv = (1.0 - across_gap) * next_values + across_gap * gap_value
    deltas = rewards + gamma * nv * not_term - values
    # An episode boundary flagged on an inactive step still cuts the trace.
    last = _backward_scan(act * decay + (1.0 - act) * not_ended, act * deltas)
    advantages = act * last
    return advantages, advantages + values


def _backward_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x_t = a_t * x_{t+1} + b_t over dim 0, from x_T = 0."""
    return linear_scan(a.flip(0), b.flip(0), 0)[1].flip(0)
