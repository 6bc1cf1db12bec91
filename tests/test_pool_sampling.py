"""Opponent sampling (league/sampling.py): each strategy's weights, the names the config offers, and the league
weighting its pool by the one the config names."""

import pytest
import torch
from test_league import RPS, _league

from phalanx.config import FIELDS
from phalanx.errors import ConfigError
from phalanx.league.sampling import POOL_SAMPLING, Candidate, latest, pfsp, pool_sampling, uniform


def test_the_config_offers_exactly_the_strategies():
    assert FIELDS["pool_sampling"].metadata["choices"] == tuple(POOL_SAMPLING)
    assert FIELDS["pool_sampling"].default in POOL_SAMPLING


def test_uniform_and_latest():
    pool = [Candidate(300), Candidate(100), Candidate(300), Candidate(200)]
    assert uniform(pool) == [1.0, 1.0, 1.0, 1.0]
    assert latest(pool) == [1.0, 0.0, 0.0, 0.0]  # the first of the newest


def test_pfsp_favours_the_snapshots_the_learner_does_not_beat():
    pool = [Candidate(1), Candidate(2, learner_wins=4), Candidate(3, learner_losses=4),
            Candidate(4, learner_wins=1, learner_draws=2, learner_losses=1)]
    # score 0.5 before any game, 1 after only wins, 0 after only losses, (1 + 0.5 * 2) / 4 = 0.5
    assert pfsp(pool) == [0.25 + 0.05, 0.05, 1.05, 0.25 + 0.05]


def test_an_unknown_strategy_is_one_line_naming_the_key_and_the_names():
    with pytest.raises(ConfigError, match="config key 'pool_sampling' must be one of uniform, latest, pfsp; got 'newest'"):
        pool_sampling("newest")


@pytest.mark.parametrize("name", sorted(POOL_SAMPLING))
def test_the_league_weights_its_pool_by_the_named_strategy(tmp_path, name, monkeypatch):
    monkeypatch.setitem(RPS, "pool_sampling", name)
    league, _, model = _league(tmp_path, "self_play:2,rock:1", n=6)
    snaps = [league.snapshot(step, model, None) for step in (100, 200, 300)]
    league.ratings.record_counts(snaps[0].name, 3, 0, 1)
    league.ratings.record_counts(snaps[1].name, 0, 0, 2)
    league._refresh()
    got = torch.stack([league.weights[league.players.index(s)] for s in snaps])
    want = torch.tensor(POOL_SAMPLING[name]([Candidate(100, 3, 0, 1), Candidate(200, 0, 0, 2), Candidate(300)]))
    torch.testing.assert_close(got, 2.0 * want / want.sum())  # the pool shares self_play's weight
    assert league.weights[league.players.index(next(o for o in league.opponents if o.name == "rock"))] == 1.0
