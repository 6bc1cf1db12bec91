"""How self-play picks among the pool's snapshots (config key `pool_sampling`): one weight per snapshot.

A strategy is a function of the pool, the snapshots as `Candidate`s in the league's layout order, to their
weights (any non-negative numbers with a positive sum; the league scales them to the mix's `self_play`
weight). A new one is a function here and its name in `POOL_SAMPLING` (and in config.py's choices, which a
test keeps equal). Pure: no torch, no I/O; the league (league.py) reads the ratings and keeps the files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from phalanx.errors import ConfigError


@dataclass(frozen=True)
class Candidate:
    """A snapshot in the pool as sampling sees it: when it was taken and the learner's games against it."""

    step: int
    learner_wins: int = 0
    learner_draws: int = 0
    learner_losses: int = 0


class PoolSampling(Protocol):
    def __call__(self, pool: Sequence[Candidate]) -> list[float]: ...


def uniform(pool: Sequence[Candidate]) -> list[float]:
    """Every snapshot alike."""
    return [1.0] * len(pool)


def latest(pool: Sequence[Candidate]) -> list[float]:
    """The newest snapshot only (the first of equals)."""
    newest = max(range(len(pool)), key=lambda i: pool[i].step)
    return [1.0 if i == newest else 0.0 for i in range(len(pool))]


def pfsp(pool: Sequence[Candidate]) -> list[float]:
    """Prioritized fictitious self-play: (1 - the learner's score against it)^2 + 0.05, favouring the snapshots
    the learner does not yet beat (score: wins plus half the draws per game; 0.5 before any game)."""
    out = []
    for c in pool:
        n = c.learner_wins + c.learner_draws + c.learner_losses
        score = (c.learner_wins + 0.5 * c.learner_draws) / n if n else 0.5
        out.append((1.0 - score) ** 2 + 0.05)
    return out


POOL_SAMPLING: dict[str, PoolSampling] = {"uniform": uniform, "latest": latest, "pfsp": pfsp}


def pool_sampling(name: str) -> PoolSampling:
    """The strategy called `name`; a ConfigError naming the key and the allowed names otherwise."""
    if name not in POOL_SAMPLING:
        raise ConfigError(f"config key 'pool_sampling' must be one of {', '.join(POOL_SAMPLING)}; got {name!r}")
    return POOL_SAMPLING[name]
