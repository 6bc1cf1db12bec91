"""duel: spaces, knockouts, match ends, hits and knockback, controls, scripts, batching and resume."""

from __future__ import annotations

import pytest
import torch

import phalanx.envs as penvs
from phalanx.envs.spaces import Box, MultiDiscrete
from phalanx.errors import ConfigError
from phalanx.zoo.duel import (
    FEATURES,
    HEAVY,
    HELD,
    JUMP,
    KO_STEPS,
    LIGHT,
    LYING,
    MAX_DAMAGE,
    NUM_KEYS,
    PICKUP,
    REWARD_TERMS,
    REWARD_WEIGHTS,
    RIGHT,
    THROW,
    DuelEnv,
    mirror_features,
)

F = {name: i for i, name in enumerate(FEATURES)}


def _keys(n: int, *pressed: tuple[int, int]) -> torch.Tensor:
    """Keys [n, 2, 10] with (slot, key) pairs pressed in every env."""
    a = torch.zeros(n, 2, NUM_KEYS, dtype=torch.long)
    for slot, key in pressed:
        a[:, slot, key] = 1
    return a


def _standoff(env: DuelEnv, gap: float = 1.0, x0: float = 0.0) -> None:
    """Both fighters standing on the main platform, facing each other `gap` apart, weapon out of play."""
    env.set_fighters(x=torch.tensor([x0 - gap / 2, x0 + gap / 2]), y=0.0, facing=torch.tensor([1.0, -1.0]))
    env.set_weapon(0, timer=10_000)


def test_spaces_shapes_and_registration():
    env = penvs.make("duel", num_envs=3, seed=0)
    assert isinstance(env, DuelEnv) and env.num_agents == 2
    assert env.action_space == MultiDiscrete((2,) * 10)
    assert isinstance(env.observation_space, Box) and env.observation_space.shape == (64,)
    assert env.state_space.shape == (64,)
    assert env.reward_terms == REWARD_TERMS and len(REWARD_TERMS) == len(REWARD_WEIGHTS) == 9
    assert set(env.scripted_names) == {"based", "constant", "random"}
    assert len(FEATURES) == 32
    rec = env.reset()
    assert rec.obs.shape == (3, 2, 64) and rec.obs.dtype == torch.float32
    assert rec.state.shape == (3, 64)
    rec = env.step(env.scripted_actions("random", rec, torch.Generator().manual_seed(0)))
    assert rec.reward.shape == (3, 2) and rec.reward.dtype == torch.float32
    for flag in (rec.terminated, rec.truncated, rec.active, rec.trial_end):
        assert flag.shape == (3, 2) and flag.dtype == torch.bool
    assert rec.active.all() and rec.final_obs.shape == rec.obs.shape
    assert "episode_return" not in rec.info and rec.info["match_length"].shape == (3,)
    assert rec.info["win"].shape == (3, 2) and rec.info["reward_win"].shape == (3, 2)
    spec = penvs.spec("duel")
    assert spec.options["time_limit"].default == 2700 and spec.options["stocks"].default == 3
    with pytest.raises(ConfigError):
        penvs.make("duel", stocks=0)


def test_perspective_mirror_and_state():
    env = DuelEnv(num_envs=2, seed=3)
    rec = env.reset()
    for _ in range(5):
        rec = env.step(env.scripted_actions("random", rec, torch.Generator().manual_seed(1)))
    obs = rec.obs
    # Slot 0's opponent block is slot 1's own block seen in slot 0's frame, and vice versa.
    assert torch.allclose(obs[:, 0, 32:], mirror_features(obs[:, 1, :32]))
    assert torch.allclose(obs[:, 1, 32:], mirror_features(obs[:, 0, :32]))
    assert torch.equal(rec.state, obs[:, 0])
    # At the start both fighters see themselves on the left, facing right, the opponent on the right.
    start = env.reset().obs
    assert (start[:, :, F["x"]] < 0).all() and (start[:, :, 32 + F["x"]] > 0).all()
    assert (start[:, :, F["facing"]] == 1).all()


def test_knockout_loses_a_stock_then_respawns_after_90_steps():
    env = DuelEnv(num_envs=2, seed=0)
    env.reset()
    env.set_weapon(0, timer=10_000)
    # env 0: fighter 0 past the side bound; env 1: above the top bound.
    env.set_fighters(x=torch.tensor([[14.5, 3.0], [0.0, 3.0]]), y=torch.tensor([[3.0, 0.0], [8.5, 0.0]]))
    env.set_fighters(damage=torch.tensor([250.0, 40.0]))
    spawn = env.st["spawn_x"][:, 0].clone()
    idle = _keys(2)
    rec = env.step(idle)
    assert env.st["stocks"][:, 0].tolist() == [2, 2] and env.st["stocks"][:, 1].tolist() == [3, 3]
    assert (rec.obs[:, 0, F["ko"]] == 1).all() and (rec.obs[:, 1, 32 + F["ko"]] == 1).all()
    assert torch.allclose(rec.reward[:, 0], torch.tensor(-8.0), atol=0.1)
    assert torch.allclose(rec.reward[:, 1], torch.tensor(8.0), atol=0.1)
    assert not rec.terminated.any()
    for _ in range(KO_STEPS - 1):
        rec = env.step(idle)
        assert (rec.obs[:, 0, F["ko"]] == 1).all()
        assert (rec.reward[:, 1] == 0).all()  # a parked fighter cannot be hit or score
    rec = env.step(idle)
    assert (rec.obs[:, 0, F["ko"]] == 0).all()
    assert torch.equal(env.st["x"][:, 0], spawn)
    assert (env.st["y"][:, 0] > 1.5).all() and (env.st["y"][:, 0] < 2.0).all()  # respawned above, falling
    assert (env.st["damage"][:, 0] == 0).all() and (env.st["damage"][:, 1] == 40).all()


def test_last_stock_terminates_with_win_and_loss():
    env = DuelEnv(num_envs=2, seed=0)
    rec = env.reset()
    env.set_fighters(stocks=torch.tensor([[3, 1], [3, 2]]), x=torch.tensor([[-3.0, 20.0], [-3.0, 20.0]]), y=0.0)
    rec = env.step(_keys(2))
    assert rec.terminated[0].all() and not rec.terminated[1].any()
    assert not rec.truncated.any()
    info = rec.info
    assert info["win"][0].tolist() == [1.0, 0.0] and info["loss"][0].tolist() == [0.0, 1.0]
    assert info["draw"][0].tolist() == [0.0, 0.0] and info["knockouts"][0].tolist() == [1.0, 0.0]
    assert info["match_length"].tolist() == [1.0, 0.0]
    assert info["win"][1].tolist() == [0.0, 0.0]  # env 1 goes on: nothing reported
    assert torch.allclose(info["reward_win"][0], torch.tensor([50.0, -50.0]))
    assert torch.allclose(info["reward_knockout"][0], torch.tensor([8.0, -8.0]))
    assert rec.reward[0, 0] > 57 and rec.reward[0, 1] < -57
    # Auto-reset: the next match starts with full stocks; final_obs keeps the last one.
    assert env.st["stocks"][0].tolist() == [3, 3] and env.st["t"][0] == 0
    assert rec.final_obs[0, 1, F["stocks"]] == 0 and rec.obs[0, 1, F["stocks"]] == 1
    assert torch.equal(rec.final_obs[1], rec.obs[1])


def test_time_limit_truncates_and_compares_stocks():
    env = DuelEnv(num_envs=2, seed=0, time_limit=5)
    env.reset()
    env.set_fighters(stocks=torch.tensor([[3, 2], [2, 2]]))
    for _ in range(4):
        rec = env.step(_keys(2))
        assert not rec.truncated.any()
    rec = env.step(_keys(2))
    assert rec.truncated.all() and not rec.terminated.any()
    assert rec.info["win"].tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert rec.info["loss"].tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert rec.info["draw"].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert rec.info["match_length"].tolist() == [5.0, 5.0]
    assert torch.allclose(rec.reward[0], torch.tensor([50.0, -50.0]), atol=0.01)
    assert torch.allclose(rec.reward[1], torch.zeros(2), atol=0.01)


def _heavy_hit(victim_damage: torch.Tensor, holding: bool = False) -> tuple[DuelEnv, list]:
    """Fighter 0 heavy-attacks fighter 1 standing 1 unit away; returns the env right after the hit."""
    n = len(victim_damage)
    env = DuelEnv(num_envs=n, seed=0)
    env.reset()
    _standoff(env)
    env.set_fighters(damage=torch.stack((torch.zeros(n), victim_damage), 1))
    if holding:
        env.set_weapon(HELD, owner=0)
    recs = [env.step(_keys(n, (0, HEAVY)))]
    while (env.st["damage"][:, 1] == victim_damage).all() and len(recs) < 30:
        recs.append(env.step(_keys(n)))
    return env, recs


def test_hit_deals_damage_and_knockback_grows_with_damage():
    before = torch.tensor([0.0, 100.0, 695.0])
    env, recs = _heavy_hit(before)
    assert 9 <= len(recs) <= 14  # the heavy's startup
    dealt = env.st["damage"][:, 1] - before
    assert torch.allclose(dealt, torch.tensor([12.0, 12.0, 5.0]))  # clamped at 700
    assert env.st["damage"][2, 1] == MAX_DAMAGE
    vx, vy = env.st["vx"][:, 1], env.st["vy"][:, 1]
    assert (vx > 0).all() and (vy > 0).all()  # launched away and up
    assert vx[0] < vx[1] < vx[2]
    assert (env.st["stun"][:, 1] > 0).all() and env.st["stun"][0, 1] < env.st["stun"][1, 1]
    assert torch.allclose(recs[-1].reward[:, 0] - recs[-1].reward[:, 1], 2 * dealt / 140, atol=1e-4)
    # The hit is counted once per move; a fighter at high damage is launched past the bounds.
    ko = torch.zeros(3, dtype=torch.bool)
    for _ in range(120):
        ko |= env.step(_keys(3)).reward[:, 1] < -7
    assert torch.allclose(env.st["ep_dealt"][:, 0], dealt) and torch.allclose(env.st["ep_taken"][:, 1], dealt)
    assert ko.tolist() == [False, False, True]


def test_weapon_pickup_boosts_damage_and_throw_and_drop():
    env = DuelEnv(num_envs=1, seed=0)
    env.reset()
    _standoff(env, gap=4.0)
    env.set_weapon(LYING, x=-2.3)
    rec = env.step(_keys(1, (0, PICKUP)))
    assert env.holding()[0].tolist() == [True, False]
    assert rec.obs[0, 0, F["weapon_held"]] == 1 and rec.obs[0, 1, 32 + F["weapon_held"]] == 1
    assert torch.allclose(rec.reward[0, 0], torch.tensor(10.0), atol=0.01)
    # Armed heavy: 1.5x damage.
    armed, _ = _heavy_hit(torch.tensor([0.0]), holding=True)
    assert armed.st["damage"][0, 1] == 18.0
    # Throw across the gap: 10 damage, then the weapon is gone.
    env.step(_keys(1, (0, THROW)))
    assert env.st["w_state"][0] == 3 and not env.holding().any()
    for _ in range(8):
        env.step(_keys(1))
    assert env.st["damage"][0, 1] == 10.0 and env.st["w_state"][0] == 0
    assert not env.holding().any()
    # A second pickup in the same life pays nothing (no farming of the respawning weapon).
    env.set_weapon(LYING, x=float(env.st["x"][0, 0]))
    rec = env.step(_keys(1, (0, PICKUP)))
    assert env.holding()[0].tolist() == [True, False] and rec.reward[0, 0].abs() < 0.5
    env.set_weapon(0, timer=10_000)
    # KO'd while holding: the drop term.
    env.set_weapon(HELD, owner=1)
    env.set_fighters(x=torch.tensor([-2.0, -15.0]))
    rec = env.step(_keys(1))
    assert torch.allclose(rec.reward[0, 1], torch.tensor(-8.0 - 15.0), atol=0.1)
    assert env.st["w_state"][0] == 0


def test_keys_move_fighters_in_their_own_frame():
    env = DuelEnv(num_envs=1, seed=0)
    rec0 = env.reset()
    x0 = env.st["x"].clone()
    for _ in range(5):
        rec = env.step(_keys(1, (0, RIGHT), (1, RIGHT)))
    x = env.st["x"]
    assert x[0, 0] > x0[0, 0] and x[0, 1] < x0[0, 1]  # slot 1's right is the world's left
    assert (rec.obs[0, :, F["x"]] > rec0.obs[0, :, F["x"]]).all()  # both see themselves move right
    assert (rec.obs[0, :, F["grounded"]] == 1).all()
    rec = env.step(_keys(1, (0, JUMP)))
    assert rec.obs[0, 0, F["grounded"]] == 0 and rec.obs[0, 0, F["airborne"]] == 1
    for _ in range(5):
        rec = env.step(_keys(1))
    assert env.st["y"][0, 0] > 1.0 and env.st["y"][0, 1] == 0.0
    assert env.st["jumps"][0, 0] == 1


def test_based_approaches_and_constant_stands_still():
    g = torch.Generator().manual_seed(0)
    env = DuelEnv(num_envs=2, seed=0)
    rec = env.reset()
    _standoff(env, gap=6.0)
    rec = env.step(_keys(2))
    start = env.st["x"].clone()
    for _ in range(15):
        rec = env.step(env.scripted_actions("constant", rec, g))
    assert torch.equal(env.st["x"], start) and (env.st["y"] == 0).all()
    for _ in range(15):
        rec = env.step(env.scripted_actions("based", rec, g))
    gap = (env.st["x"][:, 1] - env.st["x"][:, 0]).abs()
    assert (gap < 3.0).all()
    # Off to the side it heads back to the centre; close in, it attacks.
    env.set_fighters(x=torch.tensor([-6.0, 0.0]), y=0.0)
    keys = env.scripted_actions("based", rec, g)
    assert keys[:, 0, RIGHT].all() and not keys[:, 0, LIGHT].any()
    env.set_fighters(x=torch.tensor([0.0, 1.0]), y=0.0)
    keys = env.scripted_actions("based", rec, g)
    assert keys[:, :, LIGHT].all()


def test_batched_step_equals_single_env():
    big = DuelEnv(num_envs=4, seed=5)
    rec = big.reset()
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        rec = big.step(big.scripted_actions("random", rec, g))
    k = 2
    small = DuelEnv(num_envs=1, seed=5)
    small.reset()
    sd = {key: (v if key == "rng" else v[k:k + 1]) for key, v in big.state_dict().items()}
    small.load_state_dict(sd)
    for _ in range(40):
        acts = big.scripted_actions("random", rec, g)
        rec = big.step(acts)
        one = small.step(acts[k:k + 1])
        assert torch.equal(rec.obs[k:k + 1], one.obs)
        assert torch.equal(rec.reward[k:k + 1], one.reward)


def test_state_dict_round_trip_continues_identically():
    a = DuelEnv(num_envs=3, seed=7, time_limit=40)
    rec = a.reset()
    g = torch.Generator().manual_seed(1)
    for _ in range(25):
        rec = a.step(a.scripted_actions("random", rec, g))
    b = DuelEnv(num_envs=3, seed=99, time_limit=40)
    b.load_state_dict(a.state_dict())
    ended = False
    for _ in range(30):  # crosses the time limit: new matches drawn from the restored RNG
        acts = a.scripted_actions("random", rec, g)
        rec = a.step(acts)
        other = b.step(acts)
        ended |= bool(rec.truncated.any())
        for field in ("obs", "reward", "terminated", "truncated", "final_obs"):
            assert torch.equal(getattr(rec, field), getattr(other, field)), field
        for key in rec.info:
            assert torch.equal(rec.info[key], other.info[key]), key
    assert ended


def test_random_rollout_is_finite_and_terms_sum_to_reward():
    n = 8
    env = DuelEnv(num_envs=n, seed=2, time_limit=100)
    rec = env.reset()
    g = torch.Generator().manual_seed(2)
    ret = torch.zeros(n, 2)
    episodes = 0
    for _ in range(250):
        rec = env.step(env.scripted_actions("random", rec, g))
        assert torch.isfinite(rec.obs).all() and torch.isfinite(rec.reward).all()
        assert rec.obs.abs().max() <= 4.0
        ret += rec.reward
        done = (rec.terminated | rec.truncated)[:, 0]
        terms = sum(rec.info[f"reward_{t}"] for t in REWARD_TERMS)
        assert torch.allclose(terms[done], ret[done], atol=1e-3)
        assert (terms[~done] == 0).all()
        episodes += int(done.sum())
        ret[done] = 0.0
    assert episodes >= n * 2
