"""Generalized advantage estimation with the boundary semantics of DESIGN.md section 2."""

from __future__ import annotations

import torch


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
    the next active step. With `trial_bootstrap="stop"` a trial end cuts the trace like a
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
    deltas = rewards + gamma * next_values * not_term - values  # used when every step is active
    decay = gamma * gae_lambda * not_ended
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    if active is None:
        for t in range(rewards.shape[0] - 1, -1, -1):
            last = deltas[t] + decay[t] * last
            advantages[t] = last
    else:
        # An active step followed by inactive ones (a parked or not-yet-spawned slot) bootstraps from
        # the value of the slot's next active step, carried backwards across the gap, not from the
        # value of an observation it was inactive at.
        act = active.to(rewards.dtype)
        carry = torch.zeros_like(rewards[0])
        known = torch.zeros_like(rewards[0])  # 1 where `carry` holds a value from later in the rollout
        for t in range(rewards.shape[0] - 1, -1, -1):
            next_act = act[t + 1] if t + 1 < rewards.shape[0] else torch.ones_like(act[t])
            gap_value = known * carry + (1.0 - known) * next_values[t]
            nv = next_act * next_values[t] + (1.0 - next_act) * gap_value
            delta = rewards[t] + gamma * nv * not_term[t] - values[t]
            # An episode boundary flagged on an inactive step still cuts the trace.
            last = act[t] * (delta + decay[t] * last) + (1.0 - act[t]) * not_ended[t] * last
            ended_here = (1.0 - act[t]) * (1.0 - not_ended[t])
            carry = act[t] * values[t] + ended_here * not_term[t] * next_values[t] + (1.0 - act[t] - ended_here) * carry
            known = torch.maximum(known, torch.maximum(act[t], ended_here))
            advantages[t] = act[t] * last
    returns = advantages + values
    return advantages, returns
