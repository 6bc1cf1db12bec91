"""CartPole / Pendulum against gymnasium, auto-reset, state_dict round trips, the gym adapter."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch

import phalanx.envs as penvs
from phalanx.envs.spaces import Box, Discrete
from phalanx.errors import ConfigError
from phalanx.zoo.cartpole import CartPoleEnv, cartpole_dynamics
from phalanx.zoo.pendulum import PendulumEnv


def _time_limit(env: gym.Env) -> gym.wrappers.TimeLimit:
    while not isinstance(env, gym.wrappers.TimeLimit):
        env = env.env
    return env


def _sync_gym(genv: gym.Env, state: np.ndarray, elapsed: int) -> None:
    genv.reset()
    genv.unwrapped.state = state.copy()
    _time_limit(genv)._elapsed_steps = elapsed


def _run_parity(env, genvs, make_actions, steps: int) -> dict[str, int]:
    """Step the torch env and the gymnasium envs side by side; return counts of each boundary."""
    counts = {"terminated": 0, "truncated": 0, "both": 0}
    for _ in range(steps):
        acts = make_actions()
        rec = env.step(torch.as_tensor(acts))
        for i, genv in enumerate(genvs):
            gobs, grew, gterm, gtrunc, _ = genv.step(acts[i].reshape(genv.action_space.shape))
            assert bool(rec.terminated[i, 0]) == gterm
            assert bool(rec.truncated[i, 0]) == gtrunc
            assert rec.reward[i, 0].item() == pytest.approx(grew, rel=1e-5, abs=1e-5)
            np.testing.assert_allclose(rec.final_obs[i, 0].numpy(), gobs, atol=1e-5, rtol=0)
            if gterm or gtrunc:
                counts["terminated"] += gterm
                counts["truncated"] += gtrunc
                counts["both"] += gterm and gtrunc
                # The torch env already auto-reset; start gymnasium from the same state.
                _sync_gym(genv, env.physics_state[i].numpy(), 0)
            else:
                assert torch.equal(rec.obs[i], rec.final_obs[i])
    return counts


def test_cartpole_matches_gymnasium_including_time_limit():
    n = 24
    env = CartPoleEnv(num_envs=n, seed=3)
    env.reset()
    rng = np.random.default_rng(0)
    states = env.physics_state.clone()
    elapsed = torch.as_tensor(rng.integers(0, 500, n))
    # Env 0 terminates and hits the limit on the same step, env 1 only terminates, env 2 only truncates.
    states[0] = states[1] = torch.tensor([2.39, 1.0, 0.0, 0.0], dtype=torch.float64)
    states[2] = 0.0
    elapsed[0], elapsed[1], elapsed[2] = 499, 0, 499
    elapsed[3:8] = 495
    env.set_physics_state(states, elapsed)
    genvs = [gym.make("CartPole-v1") for _ in range(n)]
    for i, genv in enumerate(genvs):
        _sync_gym(genv, states[i].numpy(), int(elapsed[i]))
    counts = _run_parity(env, genvs, lambda: rng.integers(0, 2, (n, 1)), steps=300)
    assert counts["terminated"] > 20 and counts["truncated"] >= 6
    # gymnasium's TimeLimit sets truncated even when the env terminates on the last step.
    assert counts["both"] >= 1


def test_pendulum_matches_gymnasium_including_time_limit():
    n = 12
    env = PendulumEnv(num_envs=n, seed=5)
    env.reset()
    rng = np.random.default_rng(1)
    elapsed = torch.as_tensor(rng.integers(0, 200, n))
    env.set_physics_state(env.physics_state, elapsed)
    genvs = [gym.make("Pendulum-v1", disable_env_checker=True) for _ in range(n)]
    for i, genv in enumerate(genvs):
        _sync_gym(genv, env.physics_state[i].numpy(), int(elapsed[i]))
    # Actions beyond +-2 exercise the clipping inside step.
    counts = _run_parity(env, genvs, lambda: rng.uniform(-3, 3, (n, 1, 1)).astype(np.float32), steps=260)
    assert counts["terminated"] == 0 and counts["truncated"] >= n


def test_cartpole_autoreset_and_episode_info():
    n = 6
    env = CartPoleEnv(num_envs=n, seed=0)
    env.reset()
    states = env.physics_state.clone()
    states[:3] = torch.tensor([-2.39, -1.0, 0.1, 0.0], dtype=torch.float64)  # leaves the track next step
    env.set_physics_state(states, torch.tensor([7, 0, 3, 2, 2, 2]))
    actions = torch.zeros(n, 1, dtype=torch.long)
    expected, term = cartpole_dynamics(states, actions[:, 0])
    rec = env.step(actions)
    done = torch.tensor([True] * 3 + [False] * 3)
    assert torch.equal(rec.terminated[:, 0], done) and not rec.truncated.any()
    assert torch.equal(rec.final_obs[:, 0], expected.float())
    assert rec.obs[:3].abs().max() <= 0.05 and not torch.equal(rec.obs[:3], rec.final_obs[:3])
    assert torch.equal(rec.obs[3:], rec.final_obs[3:])
    assert torch.equal(rec.info["episode_length"], torch.tensor([8.0, 1.0, 4.0, 0.0, 0.0, 0.0]))
    # Returns count only the rewards actually collected (the counters were set by hand).
    assert torch.equal(rec.info["episode_return"], torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(env.elapsed, torch.tensor([0, 0, 0, 3, 3, 3]))
    assert rec.obs.dtype == torch.float32 and rec.reward.dtype == torch.float32
    assert rec.active.all() and not rec.trial_end.any() and rec.reward.shape == (n, 1)


def test_reset_seed_is_deterministic():
    a, b = CartPoleEnv(num_envs=4, seed=1), CartPoleEnv(num_envs=4, seed=2)
    assert not torch.equal(a.reset().obs, b.reset().obs)
    ra, rb = a.reset(seed=9), b.reset(seed=9)
    assert torch.equal(ra.obs, rb.obs) and ra.obs.abs().max() <= 0.05
    assert torch.equal(ra.obs, ra.final_obs) and not ra.terminated.any()


@pytest.mark.parametrize("cls,make_actions", [
    (CartPoleEnv, lambda g, n: torch.randint(0, 2, (n, 1), generator=g)),
    (PendulumEnv, lambda g, n: torch.rand(n, 1, 1, generator=g) * 4 - 2),
])
def test_state_dict_round_trip_is_bit_identical(cls, make_actions):
    n, g = 8, torch.Generator().manual_seed(0)
    a, b = cls(num_envs=n, seed=1, max_steps=40), cls(num_envs=n, seed=2, max_steps=40)
    a.reset()
    b.reset()
    for _ in range(25):
        a.step(make_actions(g, n))
    saved = a.state_dict()
    acts = [make_actions(g, n) for _ in range(120)]  # crosses resets from both limits and failures
    ref = [a.step(x) for x in acts]
    for env in (b, a):  # a fresh env and the original (its later steps must not leak into `saved`)
        env.load_state_dict(saved)
        for x, r in zip(acts, ref):
            got = env.step(x)
            assert torch.equal(got.obs, r.obs) and torch.equal(got.final_obs, r.final_obs)
            assert torch.equal(got.truncated, r.truncated) and torch.equal(got.terminated, r.terminated)
            assert torch.equal(got.info["episode_return"], r.info["episode_return"])
    assert sum(int(r.truncated.sum()) for r in ref) > 0


def test_registry_and_spaces():
    env = penvs.make("cartpole", num_envs=8, max_steps=3)
    assert env.action_space == Discrete(2) and env.observation_space.shape == (4,)
    rec = env.reset(seed=1)
    for _ in range(3):
        rec = env.step(torch.zeros(8, 1, dtype=torch.long))
    assert rec.truncated.all()
    pend = penvs.make("pendulum", num_envs=2)
    assert isinstance(pend.action_space, Box) and pend.action_space.shape == (1,)
    assert pend.reset().obs.shape == (2, 1, 3)
    with pytest.raises(ConfigError):
        penvs.make("cartpole", bogus=1)


def test_gym_adapter_matches_plain_gymnasium():
    n, seed = 3, 11
    env = penvs.make("gym:CartPole-v1", num_envs=n, seed=seed, max_episode_steps=15)
    assert env.action_space == Discrete(2) and env.observation_space.shape == (4,)
    plain = [gym.make("CartPole-v1", max_episode_steps=15) for _ in range(n)]
    rec = env.reset()
    want = np.stack([p.reset(seed=seed + i)[0] for i, p in enumerate(plain)])
    assert rec.obs.shape == (n, 1, 4) and rec.obs.dtype == torch.float32
    np.testing.assert_array_equal(rec.obs[:, 0].numpy(), want)
    rng = np.random.default_rng(2)
    seen = {"terminated": 0, "truncated": 0}
    for _ in range(60):
        acts = rng.integers(0, 2, n)
        rec = env.step(torch.as_tensor(acts).reshape(n, 1))
        assert rec.reward.shape == (n, 1) and rec.reward.dtype == torch.float32
        assert rec.terminated.dtype == torch.bool and rec.terminated.shape == (n, 1)
        for i, p in enumerate(plain):
            obs, rew, term, trunc, _ = p.step(int(acts[i]))
            assert (bool(rec.terminated[i, 0]), bool(rec.truncated[i, 0])) == (term, trunc)
            np.testing.assert_array_equal(rec.final_obs[i, 0].numpy(), obs)
            if term or trunc:
                seen["terminated"] += term
                seen["truncated"] += trunc
                assert rec.info["episode_length"][i] > 0
                np.testing.assert_array_equal(rec.obs[i, 0].numpy(), p.reset()[0])
            else:
                np.testing.assert_array_equal(rec.obs[i, 0].numpy(), obs)
    assert seen["terminated"] > 0 and seen["truncated"] > 0
    assert env.state_dict() == {}
    env.close()


@pytest.mark.parametrize("where", ["obs", "reward", "final_obs"])
def test_gym_adapter_vouches_for_finite_records_only(where):
    """StepRecord.finite lets the trainer skip its own test, so it must be False wherever a number is not."""
    env = penvs.make("gym:CartPole-v1", num_envs=3, seed=0)
    env.reset()
    inner = env.envs[1]
    step = inner.step

    def broken(action):
        obs, reward, term, trunc, info = step(action)
        if where == "reward":
            reward = float("nan")
        else:  # a NaN final observation comes with the episode's end
            obs, term = obs * np.nan, term or where == "final_obs"
        return obs, reward, term, trunc, info

    zeros = torch.zeros(3, 1, dtype=torch.long)
    assert env.step(zeros).finite
    inner.step = broken
    rec = env.step(zeros)
    assert not rec.finite
    assert not all(torch.isfinite(getattr(rec, where)).all() for where in ("obs", "reward", "final_obs"))
    inner.step = step
    assert env.step(zeros).finite
    env.close()


def test_gym_adapter_box_actions():
    env = penvs.make("gym:Pendulum-v1", num_envs=2, seed=0)
    assert isinstance(env.action_space, Box) and env.action_space.shape == (1,)
    env.reset()
    rec = env.step(torch.full((2, 1, 1), 2.0))
    assert rec.obs.shape == (2, 1, 3) and (rec.reward < 0).all()


def test_gym_adapter_unknown_id_is_config_error():
    with pytest.raises(ConfigError, match="NoSuchEnv-v0") as err:
        penvs.make("gym:NoSuchEnv-v0", num_envs=2)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cartpole_and_pendulum_step_on_gpu_without_host_sync():
    for cls, act in ((CartPoleEnv, torch.ones(64, 1, dtype=torch.long)), (PendulumEnv, torch.ones(64, 1, 1))):
        env = cls(num_envs=64, device="cuda", seed=0, max_steps=5)
        env.reset()
        act = act.cuda()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(12):
                rec = env.step(act)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert rec.obs.device.type == "cuda" and rec.truncated.any().item() is False
        assert math.isfinite(rec.reward.sum().item())


@pytest.mark.parametrize("env_id", ["FrozenLake-v1", "Blackjack-v1"])
def test_gym_adapter_sync_and_async_agree_on_flattened_spaces(env_id):
    """The adapter's own loop over the copies gives what gymnasium's AsyncVectorEnv gives, step for step,
    through resets, for observation spaces that are flattened (Discrete one-hot, Tuple)."""
    n = 3
    envs = [penvs.make(f"gym:{env_id}", num_envs=n, seed=5, vectorization_mode=mode) for mode in ("sync", "async")]
    first = [e.reset() for e in envs]
    torch.testing.assert_close(first[0].obs, first[1].obs, rtol=0, atol=0)
    rng = np.random.default_rng(0)
    ended = 0
    for _ in range(40):
        acts = torch.as_tensor(rng.integers(0, envs[0].action_space.n, (n, 1)))
        sync, asyn = (e.step(acts) for e in envs)
        for field in ("obs", "final_obs", "reward", "terminated", "truncated"):
            torch.testing.assert_close(getattr(sync, field), getattr(asyn, field), rtol=0, atol=0)
        torch.testing.assert_close(sync.info["episode_length"], asyn.info["episode_length"], rtol=0, atol=0)
        ended += int((sync.terminated | sync.truncated).sum())
    assert ended > 0 and sync.obs.shape == (n, 1, *envs[0].observation_space.shape)
    for e in envs:
        e.close()


def test_a_tuned_gym_task_gets_its_peers_settings_under_the_users_config():
    """`gym:LunarLander-v3` trains at the RL Zoo's settings unless the user says otherwise; other ids keep the
    schema's defaults; the name is listed with the built-in envs."""
    from phalanx.config import FIELDS, resolve
    from phalanx.envs.adapters.gym import TUNED

    cfg = resolve({"env": "gym:LunarLander-v3"})
    tuned = TUNED["LunarLander-v3"][1]
    assert {k: getattr(cfg, k) for k in tuned} == tuned
    assert (cfg.clip_vloss, cfg.anneal_lr, cfg.num_minibatches) == (False, False, 256)
    mine = resolve({"env": "gym:LunarLander-v3"}, {"clip_vloss": True, "num_envs": 4})
    assert (mine.clip_vloss, mine.num_envs, mine.gamma) == (True, 4, 0.999)
    plain = resolve({"env": "gym:CartPole-v1"})
    assert (plain.clip_vloss, plain.num_envs) == (FIELDS["clip_vloss"].default, FIELDS["num_envs"].default)
    assert "gym:LunarLander-v3" in penvs.registered()
