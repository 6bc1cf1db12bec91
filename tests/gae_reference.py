"""An independent GAE reference: plain Python, one slot, walking forward from each step."""

from __future__ import annotations


def forward_reference(r, v, nv, term, trunc, active, trial_end, gamma, lam, stop, active_after=True, idle_rewards=False):
    """Advantage of each step of one slot, by the boundary table of docs/DESIGN.md section 2, walking forward.
    `active_after`: whether the slot acts right after the rollout (at the observation `nv[-1]` values);
    `idle_rewards`: a turn-based env's rewards on steps the slot sat out count for its last move."""
    T = len(r)

    def no_bootstrap(u):
        return term[u] or (stop and trial_end[u])

    def reward(t):
        """r[t] and, where the episode goes on, the rewards that reach the slot while it sits out after t
        (PettingZoo's last(): a reward on another's turn belongs to the slot's last action), up to its next
        active step or the step that ends its episode, that one's included."""
        total = r[t]
        if not idle_rewards or no_bootstrap(t) or trunc[t]:
            return total
        u = t + 1
        while u < T and not active[u]:
            total += r[u]
            if no_bootstrap(u) or trunc[u]:
                break
            u += 1
        return total

    def adv(t):
        if not active[t]:
            return 0.0
        rt = reward(t)
        if no_bootstrap(t):
            return rt - v[t]
        if trunc[t]:
            return rt + gamma * nv[t] - v[t]
        u = t + 1
        while u < T and not active[u]:  # the slot sits out; an episode may end while it does
            if no_bootstrap(u):
                return rt - v[t]
            if trunc[u]:
                return rt + gamma * nv[u] - v[t]
            u += 1
        if u == T:  # the gap runs past the rollout: V of what follows it, where the slot acts there
            if not active_after:
                return 0.0  # no bootstrap yet: left out of this update, and the trace before it stops here
            return rt + gamma * nv[T - 1] - v[t]
        following = nv[t] if u == t + 1 else v[u]
        return rt + gamma * following - v[t] + gamma * lam * adv(u)

    return [adv(t) for t in range(T)]


def pending_reference(active, term, trunc, trial_end, stop, active_after):
    """Which steps of one slot have no bootstrap yet: active, the episode goes on, and the slot sits out
    (no episode end flagged) to the rollout's end and does not act right after it."""
    T = len(active)

    def pending(t):
        if not active[t] or term[t] or trunc[t] or (stop and trial_end[t]):
            return False
        u = t + 1
        while u < T and not active[u]:
            if term[u] or trunc[u] or (stop and trial_end[u]):
                return False
            u += 1
        return u == T and not active_after

    return [pending(t) for t in range(T)]
