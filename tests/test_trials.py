"""Multi-trial episodes: MultiTrialEnv flags and metrics, and the trial_nav workload."""

from __future__ import annotations

import pytest
import torch

from phalanx.envs import make
from phalanx.envs.trials import MultiTrialEnv
from phalanx.errors import ConfigError
from phalanx.zoo.cartpole import CartPoleEnv
from phalanx.zoo.trial_nav import DOORS, GRID, STEP_PENALTY, TrialNavEnv, TrialNavWorld, seed_draws

K, L = 4, 7


def _env(n=16, **kw) -> TrialNavEnv:
    kw.setdefault("trials", K)
    return make("trial_nav", num_envs=n, seed=kw.pop("seed", 0), **kw)


def _inner_obs(env, obs):
    return obs[..., : env.inner.obs_dim]


def _distances(env) -> torch.Tensor:
    """Steps [N, A] from each ego's start to the goal exit (the oracle's arrival step)."""
    doors = torch.tensor(DOORS)
    goal = doors[env.inner.goal].unsqueeze(1)
    return (env.inner.start - goal).abs().sum(-1)


def _run_episodes(env, choose, max_steps=None):
    """Step until every env ended its first episode; returns per-env info rows of that episode and all records."""
    n = env.num_envs
    rec = env.reset(seed=3)
    gen = torch.Generator().manual_seed(1)
    first = {}
    done_once = torch.zeros(n, dtype=torch.bool)
    records = [rec]
    for _ in range(max_steps or K * L):
        last_trial = env.trial == K - 1
        rec = env.step(choose(env, rec, gen))
        records.append(rec)
        # The episode end: the last trial's end (a slot parked by then is not flagged again).
        ended = rec.trial_end[:, 0] & last_trial & ~done_once
        for k, v in rec.info.items():
            first.setdefault(k, torch.zeros(n))
            first[k] = torch.where(ended, v, first[k])
        done_once |= rec.trial_end[:, 0] & last_trial
    assert bool(done_once.all())
    return first, records


def scripted(name):
    return lambda env, rec, gen: env.scripted_actions(name, rec, gen)


def sweep_then_oracle(env, rec, gen):
    """'Remember the goal': explore in trial 0, then replay the exit found (an oracle after trial 0)."""
    sweep = env.scripted_actions("sweep", rec, gen)
    oracle = env.scripted_actions("oracle", rec, gen)
    return torch.where((env.trial > 0).unsqueeze(1), oracle, sweep)


def stay(env, rec, gen):
    return torch.zeros(env.num_envs, env.num_agents, dtype=torch.long)


def test_make_spaces_and_info_keys():
    env = _env(n=3, num_agents=3, coplayers=2)
    rec = env.reset(seed=0)
    assert rec.obs.shape == (3, 3, env.observation_space.shape[0])
    assert env.observation_space.shape[0] == GRID * GRID + 2 * 2 + 2 * 2 + 1 + K + 2
    assert rec.state.shape == (3, env.state_space.shape[0])
    assert env.scripted_names == ("random", "sweep", "remember", "oracle")
    keys = {f"trial_{i}_score" for i in range(K)} | {f"ada_delta_trial_{i}_minus_0" for i in range(1, K)}
    keys |= {"goal_reached", "trials_completed", "timed_out", "mean_trial_length"}
    assert set(rec.info) == keys
    rec = env.step(torch.zeros(3, 3, dtype=torch.long))
    assert set(rec.info) == keys and all(v.shape == (3,) for v in rec.info.values())
    assert env.success_key == "goal_reached"


def test_world_is_a_pure_function_of_the_seed():
    w = TrialNavWorld(6, num_agents=3, coplayers=3)
    seeds = torch.tensor([5, 2**40 + 7, 123456789, 0, 2**61 + 3, 99])
    obs0, state0 = w.reset_envs(torch.ones(6, dtype=torch.bool), seeds)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        w.step(torch.randint(0, 5, (6, 3), generator=gen))
    before, sb = w._obs(), w._state()
    mask = torch.tensor([True, False, True, False, True, False])
    obs1, state1 = w.reset_envs(mask, seeds)
    assert torch.equal(obs1[mask], obs0[mask]) and torch.equal(state1[mask], state0[mask])
    assert torch.equal(obs1[~mask], before[~mask]) and torch.equal(state1[~mask], sb[~mask])
    # The same seed in another batch position of another instance: the same world.
    w2 = TrialNavWorld(2, num_agents=3, coplayers=3)
    obs2, state2 = w2.reset_envs(torch.ones(2, dtype=torch.bool), seeds[[4, 1]])
    assert torch.equal(obs2, obs0[[4, 1]]) and torch.equal(state2, state0[[4, 1]])
    # Goals are uniform over the 4 exits, and independent of the start cells.
    goal, start, patrol = w.world(torch.arange(8000) * 7919 + 11)
    freq = torch.bincount(goal, minlength=4).float() / 8000
    assert (freq - 0.25).abs().max() < 0.03
    assert ((start >= 2) & (start <= 4)).all() and ((patrol[..., 1] >= 1) & (patrol[..., 1] <= 5)).all()
    assert seed_draws(torch.tensor([1, 2]), 3).unique().numel() == 6


def test_every_trial_replays_the_same_world():
    env = _env(n=16, num_agents=2, coplayers=2)
    n = env.num_envs
    table = {}  # (env, trial, step) -> (goal, seed, co-player cells)
    starts = {}  # (env, trial) -> inner observation at the trial start
    rec = env.reset(seed=7)
    gen = torch.Generator().manual_seed(0)
    episode = torch.zeros(n, dtype=torch.long)

    def note(rec):
        inner = _inner_obs(env, rec.obs)
        cop = env.inner.coplayer_pos()
        for i in range(n):
            if episode[i] > 0:
                continue
            tr, ts = int(env.trial[i]), int(env.trial_step[i])
            table[i, tr, ts] = (int(env.inner.goal[i]), int(env.episode_seed[i]), cop[i].clone())
            if ts == 0:
                starts[i, tr] = (inner[i].clone(), rec.state[i, : env.inner.state_dim].clone(), env.inner.start[i].clone())

    note(rec)
    for _ in range(K * L):
        last_trial = env.trial == K - 1
        rec = env.step(torch.randint(0, 5, (n, 2), generator=gen))
        episode += (rec.trial_end[:, 0] & last_trial).long()
        note(rec)
    assert bool((episode >= 1).all())
    for i in range(n):
        o0, s0, st0 = starts[i, 0]
        for tr in range(1, K):
            o, s, st = starts[i, tr]
            assert torch.equal(o, o0) and torch.equal(s, s0) and torch.equal(st, st0)
        for (j, tr, ts), (goal, seed, cop) in table.items():
            if j == i:
                g0, seed0, cop0 = table[i, 0, ts]
                assert goal == g0 and seed == seed0 and torch.equal(cop, cop0)
    # A new episode brings a new seed (and here, for most envs, another world).
    assert bool((env.episode_seed != torch.tensor([table[i, 0, 0][1] for i in range(n)])).all())


def test_oracle_parks_egos_and_ends_the_trial_when_all_are_parked():
    env = _env(n=32, num_agents=3, coplayers=0)
    rec = env.reset(seed=1)
    gen = torch.Generator().manual_seed(0)
    dist = _distances(env)  # [N, A]
    assert bool((dist >= 1).all()) and bool((dist <= 5).all())
    first_obs = _inner_obs(env, rec.obs).clone()
    last = dist.max(1).values + 1  # the trial ends when the last ego has acknowledged its arrival
    ended = torch.zeros(32, dtype=torch.bool)
    for s in range(1, L + 1):
        prev_active = rec.active.clone()
        rec = env.step(env.scripted_actions("oracle", rec, gen))
        live = ~ended
        arrive = (dist == s) & live.unsqueeze(1)
        # Arriving egos are paid once, stay active one more step to see their success (reward 0), then
        # are parked: inactive and unpaid until the trial ends.
        assert torch.allclose(rec.reward[arrive], torch.full_like(rec.reward[arrive], 1.0 + STEP_PENALTY))
        ack = (dist == s - 1) & live.unsqueeze(1)
        assert bool(prev_active[ack].all()) and bool((rec.reward[ack] == 0).all())
        parked = (dist < s - 1) & live.unsqueeze(1)
        assert bool((~prev_active[parked]).all()) and bool((rec.reward[parked] == 0).all())
        moving = (dist > s) & live.unsqueeze(1)
        assert torch.allclose(rec.reward[moving], torch.full_like(rec.reward[moving], STEP_PENALTY))
        te = rec.trial_end[:, 0]
        assert torch.equal(te[live], (last == s)[live])
        assert torch.equal(rec.trial_end, te.unsqueeze(1).expand(32, 3))
        assert not bool(rec.terminated.any()) and not bool(rec.truncated.any())
        still = live & ~te
        assert torch.equal(rec.active[still], (dist >= s)[still])
        # The acknowledging ego's observation says it found the goal in this trial.
        assert bool((rec.obs[arrive & ~te.unsqueeze(1)][..., -1] == 1).all())
        # Where the trial ended: every slot active again, the same start, final_obs shows the goal found.
        assert bool(rec.active[te].all())
        assert torch.equal(_inner_obs(env, rec.obs)[te], first_obs[te])
        assert bool((_inner_obs(env, rec.final_obs)[te][..., -1] == 1).all())
        assert bool((rec.final_obs[te][..., -1] == 1).all())
        assert bool((rec.obs[te][..., -1] == 0).all())  # cleared at the trial start: no memory leaks in obs
        assert torch.equal(rec.final_obs[~te], rec.obs[~te])
        ended |= te
    assert bool(ended.all())


def test_timeout_trials_and_termination_after_k_trials():
    env = _env(n=4, num_agents=2, coplayers=0)
    rec = env.reset(seed=2)
    seed0 = env.episode_seed.clone()
    for s in range(1, 2 * K * L + 1):
        rec = env.step(stay(env, rec, None))
        assert torch.allclose(rec.reward, torch.full((4, 2), STEP_PENALTY))
        assert bool(rec.active.all()) and not bool(rec.truncated.any())
        assert bool(rec.trial_end.all()) == (s % L == 0) and bool(rec.trial_end.any()) == (s % L == 0)
        assert bool(rec.terminated.all()) == (s % (K * L) == 0) and bool(rec.terminated.any()) == (s % (K * L) == 0)
        time = rec.obs[..., -2]
        assert torch.allclose(time, torch.full_like(time, (s % L) / L))
        trial = rec.obs[..., -K - 2 : -2].argmax(-1)
        assert bool((trial == (s // L) % K).all())
        if s == K * L:
            info = rec.info
            for i in range(K):
                assert bool((info[f"trial_{i}_score"] == 0).all())
            assert bool((info["timed_out"] == K).all()) and bool((info["trials_completed"] == 0).all())
            assert bool((info["mean_trial_length"] == L).all()) and bool((info["goal_reached"] == 0).all())
            assert bool((env.episode_seed != seed0).all())
        elif s < K * L:
            assert all(bool((v == 0).all()) for v in rec.info.values())


def test_oracle_metrics():
    env = _env(n=64, num_agents=2, coplayers=1)
    env.reset(seed=3)  # the worlds _run_episodes plays
    arrival = _distances(env).max(1).values.float()
    info, records = _run_episodes(env, scripted("oracle"))
    for i in range(K):
        assert bool((info[f"trial_{i}_score"] == 1).all())
    for i in range(1, K):
        assert bool((info[f"ada_delta_trial_{i}_minus_0"] == 0).all())
    assert bool((info["goal_reached"] == 1).all()) and bool((info["trials_completed"] == K).all())
    assert bool((info["timed_out"] == 0).all())
    assert torch.equal(info["mean_trial_length"], arrival + 1)  # + the acknowledge step
    # The episode ends at the end of the k-th trial: terminated for every slot active before the step (the env
    # contract: a parked slot was flagged on its own last step, and is not again), with trial_end.
    for prev, rec in zip(records, records[1:]):
        ends = rec.trial_end[:, 0] & rec.terminated.any(1)
        assert torch.equal(rec.terminated[ends], prev.active[ends])
        # Before that, terminated only marks an ego's last active step in the last trial (its
        # acknowledge step: unpaid, then parked).
        early = rec.terminated & ~rec.trial_end
        assert bool((rec.reward[early] == 0).all()) and not bool(rec.active[early].any())


def test_terminated_only_in_the_last_trial():
    env = _env(n=32, num_agents=3, coplayers=0)
    rec = env.reset(seed=6)
    gen = torch.Generator().manual_seed(0)
    dist = _distances(env)  # the oracle's arrival step per ego, the same in every trial
    last = dist.max(1).values + 1
    first_episode = torch.ones(32, dtype=torch.bool)
    seen_early = False
    for _ in range(K * int(last.max())):
        trial, s = env.trial.clone(), env.trial_step + 1
        rec = env.step(env.scripted_actions("oracle", rec, gen))
        f = first_episode
        mid = f & (trial < K - 1)
        assert not bool(rec.terminated[mid].any())
        fin = f & (trial == K - 1)
        # An ego finishing the last trial is flagged on its acknowledge step (its last active step), and not
        # again when the trial, and so the episode, ends (it is parked by then: the env contract).
        want = dist + 1 == s.unsqueeze(1)
        assert torch.equal(rec.terminated[fin], want[fin])
        assert torch.equal(rec.trial_end[f, 0], (last == s)[f])
        seen_early |= bool((rec.terminated & ~rec.trial_end)[f].any())
        first_episode = f & ~(rec.trial_end[:, 0] & (trial == K - 1))
    assert not bool(first_episode.any()) and seen_early


def test_memoryless_guesses_and_memory_reaches_the_goal():
    env = _env(n=256, num_agents=2, coplayers=1)
    means = {}
    for name, choose in (("sweep", scripted("sweep")), ("random", scripted("random")),
                         ("remember_oracle", sweep_then_oracle), ("remember", scripted("remember"))):
        info, _ = _run_episodes(env, choose)
        means[name] = [float(info[f"trial_{i}_score"].mean()) for i in range(K)]
        if name == "sweep":
            # Memoryless and the world replays: every trial scores exactly like trial 0.
            for i in range(1, K):
                assert torch.equal(info[f"trial_{i}_score"], info["trial_0_score"])
                assert bool((info[f"ada_delta_trial_{i}_minus_0"] == 0).all())
    assert all(s < 0.5 for s in means["sweep"]) and 0.15 < means["sweep"][0] < 0.35
    assert all(s < 0.5 for s in means["random"])
    assert means["remember_oracle"][0] < 0.5 and all(s == 1.0 for s in means["remember_oracle"][1:])
    r = means["remember"]
    assert r[0] < r[1] < r[2] < r[3] == 1.0


def test_state_dict_round_trip():
    env = _env(n=8, num_agents=2, coplayers=2, seed=5)
    rec = env.reset(seed=5)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        rec = env.step(env.scripted_actions("remember", rec, gen))
    sd = env.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    actions = [torch.randint(0, 5, (8, 2), generator=gen) for _ in range(40)]
    want = [env.step(a) for a in actions]
    other = _env(n=8, num_agents=2, coplayers=2, seed=99)
    other.reset(seed=99)
    other.load_state_dict({k: v.clone() for k, v in sd.items()})
    got = [other.step(a) for a in actions]
    for w, g in zip(want, got):
        for field in ("obs", "reward", "terminated", "truncated", "active", "trial_end", "final_obs", "state", "final_state"):
            assert torch.equal(getattr(w, field), getattr(g, field)), field
        assert w.info.keys() == g.info.keys() and all(torch.equal(w.info[k], g.info[k]) for k in w.info)
    assert any(bool(w.terminated.any()) for w in want)  # the replay crossed an episode boundary


@pytest.mark.parametrize("opts", [
    {"trials": 0}, {"trials": 9}, {"num_agents": 0}, {"num_agents": 9}, {"coplayers": -1}, {"coplayers": 5},
    {"max_trial_steps": 0}, {"max_trial_steps": "x"}, {"size": 3},
])
def test_bad_options_raise(opts):
    with pytest.raises(ConfigError):
        make("trial_nav", num_envs=2, **opts)


def test_bad_direct_construction_raises():
    with pytest.raises(ConfigError):
        TrialNavEnv(num_envs=2, trials=9)
    with pytest.raises(ConfigError):
        TrialNavEnv(num_envs=2, max_trial_steps=0)
    with pytest.raises(ConfigError):
        TrialNavEnv(num_envs=2, num_agents=True)
    with pytest.raises(ConfigError):
        MultiTrialEnv(CartPoleEnv(num_envs=2))  # no reset_envs(mask, seeds)
    with pytest.raises(ConfigError):
        MultiTrialEnv(TrialNavWorld(2), trials=0)
