"""Regression tests for the episode-boundary and bookkeeping defects of the PPO core (issue 16).

Each test failed on the core before its fix. The GAE reference here walks forward from each step
(recursion over the slot's next active step, tests/gae_reference.py), written independently of the
backward scan in algo/gae.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gae_reference import forward_reference, pending_reference

import phalanx
from phalanx.algo import PPOBatch, StepParams, UpdateParams, compute_gae, minibatch_step, pending_bootstrap, ppo_update
from phalanx.config import Config, params_of, parse_text_layer, resolve
from phalanx.distributed import Dist
from phalanx.envs import registry
from phalanx.envs.spaces import Discrete
from phalanx.errors import ConfigError
from phalanx.models.mlp import MLPActorCritic
from phalanx.trainer import Trainer


F64 = torch.float64
QUIET = dict(progress=False, tensorboard=False)


# ================================================================================================
# 1. GAE: an active step that ends bootstraps from its own final observation, whatever follows
# ================================================================================================

def test_gae_truncated_step_followed_by_inactive_steps_bootstraps_from_its_final_obs():
    # The minimal case: step 0 truncated with V(final_obs) = 1, step 1 inactive, step 2 active.
    gamma, lam = 0.9, 0.95
    r = torch.tensor([[1.0], [0.0], [0.0]], dtype=F64)
    v = torch.tensor([[0.25], [0.0], [100.0]], dtype=F64)
    nv = torch.tensor([[1.0], [0.0], [0.0]], dtype=F64)
    trunc = torch.tensor([[True], [False], [False]])
    term = torch.zeros(3, 1, dtype=torch.bool)
    active = torch.tensor([[True], [False], [True]])
    adv, _ = compute_gae(r, v, nv, term, trunc, gamma, lam, active=active)
    assert adv[0, 0].item() == pytest.approx(1 + gamma * 1 - 0.25, abs=1e-12)
    # Terminated, and a trial end with 'stop': no bootstrap at all, nothing from the next episode.
    adv, _ = compute_gae(r, v, nv, trunc, term, gamma, lam, active=active)
    assert adv[0, 0].item() == pytest.approx(1 - 0.25, abs=1e-12)
    adv, _ = compute_gae(r, v, nv, term, term, gamma, lam, active=active, trial_end=trunc, trial_bootstrap="stop")
    assert adv[0, 0].item() == pytest.approx(1 - 0.25, abs=1e-12)


@pytest.mark.parametrize("idle_rewards", [False, True])
@pytest.mark.parametrize("mode", ["continue", "stop"])
@pytest.mark.parametrize("seed", range(40))
def test_gae_matches_forward_reference_over_random_boundaries(seed, mode, idle_rewards):
    g = torch.Generator().manual_seed(seed)
    T, N = 12, 6
    density = 0.05 + 0.3 * torch.rand((), generator=g).item()  # from rare to crowded boundaries
    r, v, nv = (torch.randn(T, N, generator=g, dtype=F64) for _ in range(3))
    term, trunc, te = (torch.rand(T, N, generator=g) < density for _ in range(3))
    active = torch.rand(T, N, generator=g) < 1 - density
    after = torch.rand(N, generator=g) < 0.5
    gamma, lam = 0.97, 0.9
    adv, ret = compute_gae(r, v, nv, term, trunc, gamma, lam, active=active, trial_end=te, trial_bootstrap=mode,
                           active_after=after, idle_rewards=idle_rewards)
    pending = pending_bootstrap(active, term, trunc, after, te, mode)
    for n in range(N):
        col = lambda x: x[:, n].tolist()  # noqa: E731
        exp = forward_reference(col(r), col(v), col(nv), col(term), col(trunc), col(active), col(te), gamma, lam, mode == "stop",
                                bool(after[n]), idle_rewards)
        assert torch.allclose(adv[:, n], torch.tensor(exp, dtype=F64), atol=1e-10), (n, adv[:, n], exp)
        assert col(pending) == pending_reference(col(active), col(term), col(trunc), col(te), mode == "stop", bool(after[n]))
    assert torch.allclose(ret, adv + v)


def test_gae_step_whose_slot_sits_out_to_the_rollouts_end_never_bootstraps_from_an_inactive_observation():
    # Issue 28: a slot parks after step 1 and sits out to the rollout's end, its episode going on. Its bootstrap
    # used to be V of the observation it was parked at (100 here: a value never trained).
    gamma, lam = 0.9, 0.95
    r = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=F64)
    v = torch.tensor([0.5, 0.25, 9.0, 9.0], dtype=F64)
    nv = torch.tensor([0.25, 100.0, 100.0, 3.0], dtype=F64)  # nv[-1]: V of the observation after the rollout
    no = torch.zeros(4, dtype=torch.bool)
    active = torch.tensor([True, True, False, False])
    # Where the slot acts right after the rollout, that observation is its next active step: V = 3.
    adv, _ = compute_gae(r, v, nv, no, no, gamma, lam, active=active, active_after=torch.tensor(True))
    step1 = 1 + gamma * 3.0 - 0.25
    assert adv.tolist() == pytest.approx([1 + gamma * 0.25 - 0.5 + gamma * lam * step1, step1, 0.0, 0.0], abs=1e-12)
    # Where it does not, step 1 has no bootstrap yet: left out (advantage 0), and step 0's trace stops at V[1].
    parked = torch.tensor(False)
    adv, _ = compute_gae(r, v, nv, no, no, gamma, lam, active=active, active_after=parked)
    assert adv.tolist() == pytest.approx([1 + gamma * 0.25 - 0.5, 0.0, 0.0, 0.0], abs=1e-12)
    assert pending_bootstrap(active, no, no, parked).tolist() == [False, True, False, False]
    # An episode end flagged while the slot sits out settles it: the step bootstraps from that end.
    trunc = torch.tensor([False, False, True, False])
    adv, _ = compute_gae(r, v, nv, no, trunc, gamma, lam, active=active, active_after=parked)
    assert adv[1].item() == pytest.approx(1 + gamma * 100.0 - 0.25, abs=1e-12)  # V(final_obs) of the truncation
    assert not pending_bootstrap(active, no, trunc, parked).any()


def test_gae_credits_a_reward_on_a_step_the_slot_sat_out_to_its_last_move():
    # Issue 50: a turn-based game. X (slot 0) moves at steps 0 and 2, O (slot 1) at step 1; X wins at step 2,
    # where the game ends for both: O's -1 comes on a step it sat out and belongs to its move at step 1 (PettingZoo's
    # last()). It used to be dropped (an inactive step trains on nothing), so O never learnt that the move lost.
    gamma, lam = 0.9, 0.95
    r = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, -1.0]], dtype=F64)
    v = torch.tensor([[0.5, 0.0], [0.0, 0.25], [0.75, 0.0]], dtype=F64)
    nv = torch.zeros(3, 2, dtype=F64)
    term = torch.tensor([[False, False], [False, False], [True, True]])
    no = torch.zeros(3, 2, dtype=torch.bool)
    active = torch.tensor([[True, False], [False, True], [True, False]])
    both = torch.ones(2, dtype=torch.bool)
    adv, _ = compute_gae(r, v, nv, term, no, gamma, lam, active=active, active_after=both, idle_rewards=True)
    assert adv[1, 1].item() == pytest.approx(-1.0 - 0.25, abs=1e-12)  # the loser's last move
    assert adv[2, 0].item() == pytest.approx(1.0 - 0.75, abs=1e-12)  # the winner's, on its own step, once
    assert adv[0, 0].item() == pytest.approx(0 + gamma * 0.75 - 0.5 + gamma * lam * (1.0 - 0.75), abs=1e-12)
    assert adv[2, 1].item() == 0.0 and adv[0, 1].item() == 0.0 and adv[1, 0].item() == 0.0
    # A reward that comes after the slot's episode ended on its own move belongs to the next episode's steps, not it.
    term_own = torch.tensor([[False, False], [False, True], [True, False]])
    adv, _ = compute_gae(r, v, nv, term_own, no, gamma, lam, active=active, active_after=both, idle_rewards=True)
    assert adv[1, 1].item() == pytest.approx(0.0 - 0.25, abs=1e-12)
    # Not turn-based (a parked slot): a reward on a step it sat out is ignored.
    adv, _ = compute_gae(r, v, nv, term, no, gamma, lam, active=active, active_after=both)
    assert adv[1, 1].item() == pytest.approx(0.0 - 0.25, abs=1e-12)


def test_update_leaves_out_a_step_whose_bootstrap_lies_beyond_the_rollout(tmp_path):
    trainer = Trainer(resolve({"env": "cartpole", "num_envs": 4, "num_steps": 16, "run_dir": str(tmp_path / "r"), **QUIET}))
    try:
        for acts_after, left_out in ((True, 6), (False, 7)):
            trainer.collect()
            trainer.run.buffer["active"][10:, 1] = False  # env 1's slot parked from step 10 on
            rec = trainer.run.rollout.record
            rec.active = rec.active.clone()
            rec.active[1] = acts_after
            trainer.update()
            # The update trains on the rows left (PPOBatch.trained_rows: the others are dropped before the minibatches).
            batch = trainer._last_batch
            assert batch.mask is None and len(batch) == 4 * 16 - left_out  # and step 9 too where it sits on
    finally:
        trainer.close()


# ================================================================================================
# 2. One bootstrap rule for every critic and device: V(final_obs) only where truncated
# ================================================================================================

def _trial_nav_trainer(tmp_path, model: str, name: str) -> Trainer:
    cfg = resolve({"env": "trial_nav", "model": model, "num_envs": 8, "num_steps": 24, "seed": 2,
                   "env_options": {"max_trial_steps": 5}, "run_dir": str(tmp_path / name), **QUIET})
    return Trainer(cfg)


@pytest.mark.parametrize("model", ["mlp", "lstm", "transformer"])
def test_trial_end_bootstraps_from_next_trial_on_every_branch(tmp_path, model):
    """`next_values[t]` is V of the observation that follows step t, also at a trial end (the first
    observation of the next trial, which the next step's value sees), and V(final_obs) only where the
    step was truncated; the whole-batch branch (accelerators) equals the truncated-rows branch (CPU)."""
    out = {}
    for whole_batch in (False, True):
        trainer = _trial_nav_trainer(tmp_path, model, f"{model}-{whole_batch}")
        try:
            trainer.run.rollout.final_values_whole_batch = whole_batch
            trainer.collect()
            out[whole_batch] = {k: trainer.run.buffer[k].clone() for k in ("next_values", "values", "trial_end", "terminated",
                                                                "truncated")}
        finally:
            trainer.close()
    b = out[False]
    assert b["trial_end"].any() and b["trial_end"][:-1].sum() > 4  # the rollout crosses trial ends
    assert torch.allclose(out[True]["next_values"], b["next_values"], atol=1e-5)
    # Wherever the episode goes on, the bootstrap is the value the next step was given.
    goes_on = ~(b["terminated"] | b["truncated"])[:-1]
    diff = (b["next_values"][:-1] - b["values"][1:]).abs()
    assert diff[goes_on].max() < 1e-5, diff[goes_on & b["trial_end"][:-1]].max()


# ================================================================================================
# 3. Value clipping under value normalisation is centred on the critic's output at collection
# ================================================================================================

def test_value_clip_centre_is_the_critics_collection_output(tmp_path):
    # The margins below were measured on the CPU's random streams (a CUDA run draws others).
    cfg = resolve({"env": "cartpole", "norm_value": True, "num_envs": 16, "num_steps": 64, "seed": 1,
                   "run_dir": str(tmp_path / "r"), "device": "cpu", **QUIET})
    trainer = Trainer(cfg)
    try:
        before = copy.deepcopy(trainer.run.model)
        trainer.collect()
        stats_before = copy.deepcopy(trainer.run.norms.value)
        metrics = trainer.update()
        batch = trainer._last_batch
        with torch.no_grad():
            raw = before.value(batch.critic_obs)  # what the critic said, in its own (normalised) units
            assert torch.allclose(batch.values, raw, atol=1e-4), (batch.values - raw).abs().max()
            # The first update moves the statistics a lot: the old centre (re-normalised with the new
            # statistics) lay far away from the critic's output, and most samples lost their gradient.
            renormalised = trainer.run.norms.value.normalize(stats_before.denormalize(raw))
            assert (renormalised - raw).abs().mean() > 5 * cfg.clip_coef
            assert metrics["value_clip_fraction"].item() < 0.1, metrics["value_clip_fraction"]
            after = trainer.run.model.value(batch.critic_obs)
            loss = lambda v: ((v - batch.returns) ** 2).mean().item()  # noqa: E731
            assert loss(after) < 0.97 * loss(raw), (loss(after), loss(raw))
    finally:
        trainer.close()


# ================================================================================================
# 4. Every sample is used in every epoch, whatever the minibatch count
# ================================================================================================

def _flat_batch(B: int) -> tuple[MLPActorCritic, PPOBatch]:
    g = torch.Generator().manual_seed(0)
    model = MLPActorCritic(3, Discrete(2), (8,), "tanh")
    obs = torch.randn(B, 1, 3, generator=g)
    obs[:, 0, 0] = torch.arange(B, dtype=torch.float32)  # tag rows
    with torch.no_grad():
        acts, logp = model.act(obs, g)
        vals = model.value(obs)
    z = torch.randn(B, 1, generator=g)
    return model, PPOBatch(obs, obs, acts, logp, z, z + vals, vals, torch.ones(B, 1))


def test_minibatch_remainder_is_spread_not_dropped():
    B, M = 26, 4  # 26 = 7 + 7 + 6 + 6
    model, batch = _flat_batch(B)
    seen: list[list[int]] = []

    def evaluate(part):
        seen.append(part.obs[:, 0, 0].long().tolist())
        lp, ent = model.evaluate(part.obs, part.actions)
        return lp, ent, model.value(part.critic_obs)

    params = list(model.parameters())
    cfg = Config(num_epochs=3, num_minibatches=M)
    ppo_update(minibatch_step(evaluate, torch.optim.Adam(params), params_of(StepParams, cfg)), batch,
               params_of(UpdateParams, cfg), generator=torch.Generator().manual_seed(1))
    assert len(seen) == 3 * M
    assert sorted(len(s) for s in seen[:M]) == [6, 6, 7, 7]
    for e in range(3):
        assert sorted(sum(seen[M * e:M * (e + 1)], [])) == list(range(B))


def test_recurrent_update_trains_every_segment(tmp_path):
    cfg = resolve({"env": "cartpole", "model": "lstm", "num_envs": 6, "num_steps": 8, "num_minibatches": 4,
                   "num_epochs": 2, "run_dir": str(tmp_path / "r"), **QUIET})
    trainer = Trainer(cfg)
    try:
        rows: list[list[int]] = []
        inner = trainer.run.update_step

        def spy(batch, idx):  # the step gathers its minibatch `batch.index(idx)` itself
            rows.append(batch.index(idx).rows.tolist())
            return inner(batch, idx)

        trainer.run.update_step = spy
        trainer.collect()
        trainer.update()
        assert len(rows) == 2 * 4
        for e in range(2):
            assert sorted(sum(rows[4 * e:4 * (e + 1)], [])) == list(range(6))
    finally:
        trainer.close()


# ================================================================================================
# 5. Bookkeeping
# ================================================================================================

def test_obs_normaliser_counts_each_observation_once(tmp_path):
    N, T = 4, 10
    cfg = resolve({"env": "cartpole", "norm_obs": True, "num_envs": N, "num_steps": T, "run_dir": str(tmp_path / "r"), **QUIET})
    trainer = Trainer(cfg)
    try:
        eps = 1e-4
        trainer.collect()
        assert trainer.run.norms.obs.count.item() == pytest.approx(eps + N * (T + 1))  # the reset obs and T steps
        trainer.update()
        trainer.collect()
        assert trainer.run.norms.obs.count.item() == pytest.approx(eps + N * (2 * T + 1))
    finally:
        trainer.close()


def test_config_error_leaves_no_run_dir_and_no_lock(tmp_path):
    run = tmp_path / "r"
    bad = dict(env="drone_swarm", model="role_attention", relay_mass=2.0, total_steps=64, num_envs=2, num_steps=8,
               run_dir=run, **QUIET)
    with pytest.raises(ConfigError, match="relay_mass"):
        phalanx.train(**bad)
    assert not run.exists()  # validated before any side effect
    result = phalanx.train(**{**bad, "relay_mass": 0.4})  # the same directory is free
    assert result.run_dir == run


def test_lock_released_when_building_the_run_fails_after_taking_it(tmp_path, monkeypatch):
    run = tmp_path / "r"
    calls = {"n": 0}
    real = Dist.barrier

    def fail_once(self):  # the barrier right after the lock is taken
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a rank went away (simulated)")
        return real(self)

    monkeypatch.setattr(Dist, "barrier", fail_once)
    with pytest.raises(RuntimeError, match="simulated"):
        phalanx.train(env="cartpole", total_steps=64, num_envs=2, num_steps=8, run_dir=run, **QUIET)
    assert (run / ".lock").exists()  # it was taken
    result = phalanx.train(env="cartpole", total_steps=64, num_envs=2, num_steps=8, run_dir=run, **QUIET)
    assert result.run_dir == run


def test_segment_rule_applies_to_memory_models_only():
    cfg = resolve({"env": "pixel_goal", "model": "cnn", "num_envs": 2, "num_minibatches": 4})
    assert cfg.num_minibatches == 4
    resolve({"env": "drone_swarm", "model": "role_attention", "num_envs": 2, "num_minibatches": 4})
    for model in ("lstm", "transformer"):
        with pytest.raises(ConfigError, match="num_minibatches"):
            resolve({"env": "cartpole", "model": model, "num_envs": 2, "num_minibatches": 4})


@pytest.mark.parametrize("text, want", [
    ("on", True), ("off", False), ("yes", True), ("no", False), ("true", True), ("0", False), ("1", True),
])
def test_bool_text_means_the_same_for_config_keys_and_env_options(text, want):
    # The command line's text (parse_text_layer); a Python caller's values are typed (tests/test_config_typing.py).
    assert resolve(parse_text_layer({"norm_obs": text})).norm_obs is want
    opts = registry.resolve_options("bucket_brigade", {"legacy_phase_order": text})
    assert opts["legacy_phase_order"] is want


@pytest.mark.parametrize("text, want", [("1e2", 100), ("2_000", 2000), ("64", 64), (64.0, 64)])
def test_int_text_means_the_same_for_config_keys_and_env_options(text, want):
    assert resolve(parse_text_layer({"num_envs": text})).num_envs == want
    assert registry.resolve_options("cartpole", {"max_steps": text})["max_steps"] == want


@pytest.mark.parametrize("text", ["maybe", "1.5", "", "nan"])
def test_bad_text_refused_alike_for_config_keys_and_env_options(text):
    with pytest.raises(ConfigError, match="num_envs"):
        resolve(parse_text_layer({"num_envs": text}))
    with pytest.raises(ConfigError, match="max_steps"):
        registry.resolve_options("cartpole", {"max_steps": text})
    with pytest.raises(ConfigError, match="norm_obs"):
        resolve(parse_text_layer({"norm_obs": text}))
    with pytest.raises(ConfigError, match="legacy_phase_order"):
        registry.resolve_options("bucket_brigade", {"legacy_phase_order": text})


@pytest.mark.parametrize("env", ["cartpole", "bucket_brigade"])
def test_quiet_step_shortcuts_change_nothing(tmp_path, env):
    """On the CPU a step where no episode ended and every number is finite skips its bookkeeping: the
    buffers, the statistics (info keys included) and the counters equal those of the full bookkeeping."""
    make = lambda name: Trainer(resolve(dict(env=env, device="cpu", num_envs=6, num_steps=40, progress=False, tensorboard=False, seed=5,  # noqa: E731
                                             run_dir=str(tmp_path / name))))
    fast, full = make("fast"), make("full")
    full.run.rollout.host_branches = False
    try:
        assert fast.run.rollout.host_branches
        for _ in range(3):
            s_fast, s_full = fast.collect(), full.collect()
            assert s_fast.keys() == s_full.keys() and s_fast["episodes"] > 0
            for k in s_full:
                assert torch.equal(s_fast[k], s_full[k]), k
            for k, buf in full.run.buffer.items():
                assert torch.equal(buf, fast.run.buffer[k]), k
            for k, v in full.run.rollout.counters.state_tensors().items():
                assert torch.equal(v, fast.run.rollout.counters.state_tensors()[k]), k
    finally:
        fast.close()
        full.close()
