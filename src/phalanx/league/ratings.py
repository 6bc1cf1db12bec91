"""Ratings of the learner, its snapshots and scripted opponents (OpenSkill's Plackett-Luce model),
and confidence intervals for win rates. Pure bookkeeping: no I/O, no torch."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from openskill.models import PlackettLuce

LEARNER = "learner"
WIN, DRAW, LOSS = 0, 1, 2  # outcome codes, always from the learner's side


@dataclass
class Player:
    mu: float
    sigma: float
    games: int = 0
    # Results of this player's games against the learner, from the learner's side.
    learner_wins: int = 0
    learner_draws: int = 0
    learner_losses: int = 0

    @property
    def ordinal(self) -> float:
        """A conservative skill estimate (mu - 3 sigma), the number tables sort by."""
        return self.mu - 3.0 * self.sigma


@dataclass
class Ratings:
    """Name -> rating. `record` rates one game of the learner against an opponent."""

    players: dict[str, Player] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._model = PlackettLuce()
        self.ensure(LEARNER)

    def ensure(self, name: str, like: str | None = None) -> Player:
        """The player `name`, created at the default prior (or a copy of `like`'s rating)."""
        if name not in self.players:
            if like is not None and like in self.players:
                src = self.players[like]
                self.players[name] = Player(src.mu, src.sigma)
            else:
                r = self._model.rating()
                self.players[name] = Player(r.mu, r.sigma)
        return self.players[name]

    def record(self, opponent: str, outcome: int, seat: str | None = None) -> None:
        """One game of the learner against `opponent` (WIN / DRAW / LOSS for the learner); with `seat` (first,
        second), the learner's rating in that seat (`learner@first`) is rated on it too, against the opponent's
        rating before the game (the opponent is rated once, by the learner's)."""
        me, other = self.ensure(LEARNER), self.ensure(opponent)
        ranks = {WIN: [0, 1], DRAW: [0, 0], LOSS: [1, 0]}[outcome]
        b = self._model.rating(mu=other.mu, sigma=other.sigma)
        if seat is not None:
            seated = self.ensure(f"{LEARNER}@{seat}")
            [[s2], _] = self._model.rate([[self._model.rating(mu=seated.mu, sigma=seated.sigma)], [b]], ranks=ranks)
            seated.mu, seated.sigma = s2.mu, s2.sigma
            seated.games += 1
        a = self._model.rating(mu=me.mu, sigma=me.sigma)
        [[a2], [b2]] = self._model.rate([[a], [b]], ranks=ranks)
        me.mu, me.sigma, other.mu, other.sigma = a2.mu, a2.sigma, b2.mu, b2.sigma
        me.games += 1
        other.games += 1
        if outcome == WIN:
            other.learner_wins += 1
        elif outcome == DRAW:
            other.learner_draws += 1
        else:
            other.learner_losses += 1

    def record_counts(self, opponent: str, wins: int, draws: int, losses: int, seat: str | None = None) -> None:
        """Several games, interleaved so the order of outcomes does not bias the result."""
        spread = [((i + 0.5) / n, code) for code, n in ((WIN, wins), (DRAW, draws), (LOSS, losses)) for i in range(n)]
        for _, code in sorted(spread):
            self.record(opponent, code, seat)

    def table(self) -> list[dict[str, Any]]:
        """Rows sorted by ordinal, best first: name, mu, sigma, ordinal, games, learner win rate vs it."""
        rows = []
        for name, p in self.players.items():
            n = p.learner_wins + p.learner_draws + p.learner_losses
            rows.append({
                "name": name, "mu": p.mu, "sigma": p.sigma, "rating": p.ordinal, "games": p.games,
                "learner_win_rate": (p.learner_wins + 0.5 * p.learner_draws) / n if n else None,
            })
        return sorted(rows, key=lambda r: -r["rating"])

    def to_json(self) -> dict[str, Any]:
        return {name: asdict(p) for name, p in self.players.items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Ratings:
        return cls({name: Player(**p) for name, p in data.items()})


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a rate (draws may count as half successes)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))
