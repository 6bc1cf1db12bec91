"""An independent GAE reference: plain Python, one slot, walking forward from each step."""

from __future__ import annotations


def forward_reference(r, v, nv, term, trunc, active, trial_end, gamma, lam, stop):
    """Advantage of each step of one slot, by the boundary table of the README, walking forward."""
    T = len(r)

    def no_bootstrap(u):
        return term[u] or (stop and trial_end[u])

    def adv(t):
        if not active[t]:
            return 0.0
        if no_bootstrap(t):
            return r[t] - v[t]
        if trunc[t]:
            return r[t] + gamma * nv[t] - v[t]
        u = t + 1
        while u < T and not active[u]:  # the slot sits out; an episode may end while it does
            if no_bootstrap(u):
                return r[t] - v[t]
            if trunc[u]:
                return r[t] + gamma * nv[u] - v[t]
            u += 1
        if u == T:
            return r[t] + gamma * nv[t] - v[t]
        following = nv[t] if u == t + 1 else v[u]
        return r[t] + gamma * following - v[t] + gamma * lam * adv(u)

    return [adv(t) for t in range(T)]
