"""Opponent pools, scripted opponents and ratings for self-play training."""

from phalanx.league.league import (
    LEAGUE_FILE,
    SNAPSHOT_DIR,
    League,
    LeagueParams,
    learner_outcome,
    load_snapshot,
    parse_mix,
)
from phalanx.league.ratings import LEARNER, Ratings, wilson_interval

__all__ = ["LEAGUE_FILE", "LEARNER", "SNAPSHOT_DIR", "League", "LeagueParams", "Ratings", "learner_outcome", "load_snapshot",
           "parse_mix", "wilson_interval"]
