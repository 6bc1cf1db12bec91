"""Tests of the PPO core: GAE, losses, the update step, action distributions and normalisers.

Expected values are computed independently (hand-written numbers or plain Python float loops),
never by calling the function under test.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from gae_reference import forward_reference
from torch import nn

from phalanx.algo import (
    Adam,
    PPOBatch,
    RewardScaler,
    RunningMeanStd,
    StepParams,
    UpdateParams,
    adam_update,
    compute_gae,
    explained_variance,
    masked_mean,
    minibatch_step,
    pending_bootstrap,
    ppo_losses,
    ppo_update,
)
from phalanx.algo.ppo import VECTOR_GATHER_MIN_ROWS
from phalanx.config import Config, params_of
from phalanx.envs.spaces import Box, Discrete, MultiDiscrete
from phalanx.models import distributions as D
from phalanx.models.layers import NARROW_INPUT_MAX_FEATURES, NARROW_WEIGHT_GRAD_MIN_ROWS, FastTanh, Linear, _rational_tanh
from phalanx.models.mlp import ActionHead, MLPActorCritic

F64 = torch.float64


def ppo_params(**kw) -> StepParams:
    """A minibatch step's settings: the config's defaults, with `kw` in their place."""
    return params_of(StepParams, Config(**kw))


def losses(newlp, ent, newv, batch, clip_coef=0.2, vf_coef=0.5, ent_coef=0.0, **kw):
    """`ppo_losses` with the hyperparameters given as keywords (or the first three positionally)."""
    return ppo_losses(newlp, ent, newv, batch, ppo_params(clip_coef=clip_coef, vf_coef=vf_coef, ent_coef=ent_coef, **kw))


def update(evaluate, model, optimizer, batch, generator=None, **kw):
    cfg = Config(**kw)
    return ppo_update(minibatch_step(evaluate, optimizer, params_of(StepParams, cfg)), batch,
                      params_of(UpdateParams, cfg), generator=generator)


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def tb(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.bool)


# ================================================================================================
# GAE
# ================================================================================================

# A T=4 trajectory with gamma = lambda = 0.5 (gamma * lambda = 0.25) so every number is exact in binary.
G, L = 0.5, 0.5
R = [1.0, 0.0, 2.0, 1.0]
V = [0.5, 1.0, 0.5, 1.0]
NV = [1.0, 0.5, 1.0, 2.0]  # V of the next observation (no boundary: V shifted, then a bootstrap of 2)
F4 = [False] * 4


def _gae(r=R, v=V, nv=NV, term=F4, trunc=F4, active=None, trial_end=None, trial_bootstrap="continue", g=G, lam=L,
         active_after=None):
    kw = {}
    if active is not None:
        kw["active"] = tb(active)
    if active_after is not None:
        kw["active_after"] = tb(active_after)
    if trial_end is not None:
        kw["trial_end"] = tb(trial_end)
    adv, ret = compute_gae(t64(r), t64(v), t64(nv), tb(term), tb(trunc), g, lam, trial_bootstrap=trial_bootstrap, **kw)
    return adv.tolist(), ret.tolist()


def _close(a, b, tol=1e-12):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= tol, (a, b)


def test_gae_no_boundary_hand_values():
    # deltas: 1 + .5*1 - .5 = 1 ; 0 + .5*.5 - 1 = -.75 ; 2 + .5*1 - .5 = 2 ; 1 + .5*2 - 1 = 1
    # adv3 = 1 ; adv2 = 2 + .25*1 = 2.25 ; adv1 = -.75 + .25*2.25 = -.1875 ; adv0 = 1 + .25*(-.1875) = .953125
    adv, ret = _gae()
    _close(adv, [0.953125, -0.1875, 2.25, 1.0])
    _close(ret, [1.453125, 0.8125, 2.75, 2.0])


def test_gae_lambda_zero_is_td_error_and_lambda_one_is_monte_carlo():
    adv, _ = _gae(lam=0.0)
    _close(adv, [1.0, -0.75, 2.0, 1.0])
    # gamma = lambda = 1: advantage = sum of future rewards + final bootstrap - V(s_t)
    adv, ret = _gae(g=1.0, lam=1.0)
    _close(ret, [1 + 0 + 2 + 1 + 2.0, 0 + 2 + 1 + 2.0, 2 + 1 + 2.0, 1 + 2.0])
    _close(adv, [6.0 - 0.5, 5.0 - 1.0, 5.0 - 0.5, 3.0 - 1.0])


def test_gae_truncation_bootstraps_from_final_obs_value_and_resets_trace():
    nv = list(NV)
    nv[1] = 3.0  # V(final_obs) of the cut episode, unrelated to V[2] (the next episode's first obs)
    adv, _ = _gae(nv=nv, trunc=[False, True, False, False])
    # delta1 = 0 + .5*3 - 1 = .5 and nothing flows from t=2 ; adv0 = 1 + .25*.5
    _close(adv, [1.125, 0.5, 2.25, 1.0])


def test_gae_termination_does_not_bootstrap():
    nv = list(NV)
    nv[1] = 3.0  # must be ignored
    adv, ret = _gae(nv=nv, term=[False, True, False, False])
    # delta1 = 0 - 1 = -1 ; adv0 = 1 + .25*(-1)
    _close(adv, [0.75, -1.0, 2.25, 1.0])
    _close(ret, [1.25, 0.0, 2.75, 2.0])


def test_gae_terminated_and_truncated_same_step_terminated_wins():
    nv = list(NV)
    nv[1] = 3.0
    both, _ = _gae(nv=nv, term=[False, True, False, False], trunc=[False, True, False, False])
    _close(both, [0.75, -1.0, 2.25, 1.0])


def test_gae_terminal_at_last_step_ignores_bootstrap():
    adv, _ = _gae(term=[False, False, False, True])
    # delta3 = 1 - 1 = 0 ; adv2 = 2 ; adv1 = -.75 + .5 = -.25 ; adv0 = 1 - .0625
    _close(adv, [0.9375, -0.25, 2.0, 0.0])


def test_gae_inactive_steps_zero_advantage_trace_passes_across():
    adv, ret = _gae(active=[True, False, True, True])
    # Step 0 bootstraps from the next *active* step's value V[2] = .5 (not from the inactive obs):
    # delta0 = 1 + .5*.5 - .5 = .75 ; adv1 = 0 ; adv0 = .75 + .25*2.25
    _close(adv, [1.3125, 0.0, 2.25, 1.0])
    _close(ret, [1.8125, 1.0, 2.75, 2.0])
    # two inactive steps in a row and an inactive final step
    adv, _ = _gae(active=[True, False, False, True])
    _close(adv, [1.25, 0.0, 0.0, 1.0])
    # An inactive final step: step 2 bootstraps from V of the observation after the rollout (NV[3] = 2), where the
    # slot acts; where it does not, step 2 has no bootstrap yet (advantage 0) and step 1 stops at V[2].
    adv, _ = _gae(active=[True, True, True, False])
    _close(adv, [1 + 0.25 * (-0.75 + 0.25 * 2.5), -0.75 + 0.25 * 2.5, 2 + 0.5 * 2.0 - 0.5, 0.0])
    adv, _ = _gae(active=[True, True, True, False], active_after=False)
    _close(adv, [1 + 0.25 * -0.75, -0.75, 0.0, 0.0])
    adv, _ = _gae(active=[False] * 4)
    _close(adv, [0.0] * 4)


def test_gae_inactive_step_values_do_not_leak():
    base, _ = _gae(active=[True, False, True, True])
    r, v, nv = list(R), list(V), list(NV)
    r[1], v[1], nv[1] = 100.0, -50.0, 7.0
    other, _ = _gae(r=r, v=v, nv=nv, active=[True, False, True, True])
    _close(base, other)


def test_gae_trial_end_continue_vs_stop():
    nv = list(NV)
    nv[1] = 3.0
    te = [False, True, False, False]
    # continue: delta1 = .5*3 - 1 = .5 and the trace flows across the trial end
    adv, _ = _gae(nv=nv, trial_end=te, trial_bootstrap="continue")
    a1 = 0.5 + 0.25 * 2.25
    _close(adv, [1 + 0.25 * a1, a1, 2.25, 1.0])
    # default is continue
    dflt, _ = _gae(nv=nv, trial_end=te)
    _close(dflt, adv)
    # stop: behaves like a termination (no bootstrap, trace cut)
    adv, _ = _gae(nv=nv, trial_end=te, trial_bootstrap="stop")
    _close(adv, [0.75, -1.0, 2.25, 1.0])


@pytest.mark.parametrize("mode", ["continue", "stop"])
def test_gae_batch_dims_match_per_column_reference(mode):
    g = torch.Generator().manual_seed(3)
    T, N, A = 9, 3, 2
    r = torch.randn(T, N, A, generator=g, dtype=F64)
    v = torch.randn(T, N, A, generator=g, dtype=F64)
    nv = torch.randn(T, N, A, generator=g, dtype=F64)
    term = torch.rand(T, N, A, generator=g) < 0.15
    trunc = torch.rand(T, N, A, generator=g) < 0.15
    active = torch.rand(T, N, A, generator=g) < 0.75
    te = torch.rand(T, N, A, generator=g) < 0.2
    gamma, lam = 0.9, 0.8
    adv, ret = compute_gae(r, v, nv, term, trunc, gamma, lam, active=active, trial_end=te, trial_bootstrap=mode)
    assert adv.shape == ret.shape == (T, N, A)
    for n in range(N):
        for a in range(A):
            col = lambda x: x[:, n, a].tolist()  # noqa: E731
            exp = forward_reference(col(r), col(v), col(nv), col(term), col(trunc), col(active), col(te), gamma, lam, mode == "stop")
            assert torch.allclose(adv[:, n, a], t64(exp), atol=1e-12)
    assert torch.allclose(ret, adv + v)
    assert torch.all(adv[~active] == 0)


def test_gae_float32_and_no_active_equals_all_active():
    g = torch.Generator().manual_seed(0)
    r, v, nv = (torch.randn(6, 4, generator=g) for _ in range(3))
    term = torch.rand(6, 4, generator=g) < 0.2
    trunc = torch.rand(6, 4, generator=g) < 0.2
    a1, r1 = compute_gae(r, v, nv, term, trunc, 0.99, 0.95)
    a2, r2 = compute_gae(r, v, nv, term, trunc, 0.99, 0.95, active=torch.ones(6, 4, dtype=torch.bool))
    assert a1.dtype == torch.float32
    assert torch.allclose(a1, a2) and torch.allclose(r1, r2)


# ================================================================================================
# PPO losses
# ================================================================================================

def _batch(oldlp, adv, ret, oldv, mask) -> PPOBatch:
    n = len(oldlp)
    return PPOBatch(
        obs=torch.zeros(n, 1, dtype=F64), critic_obs=torch.zeros(n, 1, dtype=F64), actions=torch.zeros(n, dtype=torch.long),
        logprobs=t64(oldlp), advantages=t64(adv), returns=t64(ret), values=t64(oldv), mask=t64(mask),
    )


def _ref_losses(newlp, ent, newv, oldlp, adv, ret, oldv, mask, clip, vf_coef, ent_coef, clip_vloss, vclip, norm_adv):
    idx = [i for i, m in enumerate(mask) if m]
    n = len(idx)
    a = list(adv)
    if norm_adv:
        mu = sum(adv[i] for i in idx) / n
        sd = math.sqrt(sum((adv[i] - mu) ** 2 for i in idx) / n)
        a = [(x - mu) / (sd + 1e-8) for x in adv]
    pl = vl = en = kl = cf = 0.0
    for i in idx:
        lr = newlp[i] - oldlp[i]
        r = math.exp(lr)
        rc = min(max(r, 1 - clip), 1 + clip)
        pl += max(-a[i] * r, -a[i] * rc)
        unc = (newv[i] - ret[i]) ** 2
        if clip_vloss:
            vc = oldv[i] + min(max(newv[i] - oldv[i], -vclip), vclip)
            vl += max(unc, (vc - ret[i]) ** 2)
        else:
            vl += unc
        en += ent[i]
        kl += (r - 1) - lr
        cf += 1.0 if abs(r - 1) > clip else 0.0
    pl, vl, en, kl, cf = pl / n, 0.5 * vl / n, en / n, kl / n, cf / n
    return {"policy_loss": pl, "value_loss": vl, "entropy": en, "approx_kl": kl, "clip_fraction": cf,
            "loss": pl - ent_coef * en + vf_coef * vl}


def test_ppo_losses_two_sample_hand_values():
    # ratios 1.5 (clipped to 1.2) and 0.9 (inside the clip range); advantages 2 and 1
    newlp = t64([math.log(1.5), math.log(0.9)])
    b = _batch([0.0, 0.0], [2.0, 1.0], [0.5, 1.0], [0.0, 0.0], [1.0, 1.0])
    loss, m = losses(newlp, t64([1.0, 2.0]), t64([1.0, -0.1]), b, clip_coef=0.2, vf_coef=0.5,
                         ent_coef=0.01, clip_vloss=True, norm_adv=False)
    # policy: max(-3, -2.4) = -2.4 ; max(-.9, -.9) = -.9 -> mean -1.65
    assert abs(m["policy_loss"].item() - (-1.65)) < 1e-9
    # value: max(.25, (0.2-.5)^2=.09) = .25 ; max(1.21, 1.21) -> 0.5 * mean = 0.365
    assert abs(m["value_loss"].item() - 0.365) < 1e-9
    assert abs(m["entropy"].item() - 1.5) < 1e-12
    assert abs(loss.item() - (-1.65 - 0.015 + 0.1825)) < 1e-9
    assert abs(m["loss"].item() - loss.item()) < 1e-12
    kl = ((0.5 - math.log(1.5)) + (-0.1 - math.log(0.9))) / 2
    assert abs(m["approx_kl"].item() - kl) < 1e-9
    assert m["clip_fraction"].item() == 0.5


GOLD = dict(
    newlp=[-0.5, -1.0, -0.2, -2.0, -1.1, -0.3],
    oldlp=[-0.7, -0.9, -0.6, -1.5, -1.0, -0.35],
    adv=[1.0, -2.0, -0.5, 0.5, 1.5, -0.3],
    newv=[0.5, 1.5, -0.3, 2.0, 0.1, -1.0],
    oldv=[0.4, 1.0, 0.0, 2.5, 0.3, -0.7],
    ret=[1.0, 0.8, -1.0, 2.2, 0.0, -0.2],
    ent=[1.0, 1.2, 0.8, 0.5, 0.9, 1.1],
)


@pytest.mark.parametrize("norm_adv", [False, True])
@pytest.mark.parametrize("clip_vloss,vf_clip", [(True, None), (True, 0.3), (False, None)])
@pytest.mark.parametrize("mask", [[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1]])
def test_ppo_losses_golden(norm_adv, clip_vloss, vf_clip, mask):
    g = GOLD
    clip, vf, ec = 0.2, 0.5, 0.01
    b = _batch(g["oldlp"], g["adv"], g["ret"], g["oldv"], mask)
    loss, m = losses(t64(g["newlp"]), t64(g["ent"]), t64(g["newv"]), b, clip, vf, ec,
                         clip_vloss=clip_vloss, vf_clip_coef=vf_clip, norm_adv=norm_adv)
    exp = _ref_losses(g["newlp"], g["ent"], g["newv"], g["oldlp"], g["adv"], g["ret"], g["oldv"], mask, clip, vf, ec,
                      clip_vloss, clip if vf_clip is None else vf_clip, norm_adv)
    assert abs(loss.item() - exp["loss"]) < 1e-6
    for k, v in exp.items():
        assert m[k].dim() == 0
        assert abs(m[k].item() - v) < 1e-6, (k, m[k].item(), v)


def test_ppo_losses_value_clipping_is_effective():
    # the clipped and unclipped value loss differ on GOLD, so the option is observable
    g = GOLD
    b = _batch(g["oldlp"], g["adv"], g["ret"], g["oldv"], [1] * 6)
    args = (t64(g["newlp"]), t64(g["ent"]), t64(g["newv"]), b, 0.2, 0.5, 0.0)
    _, clipped = losses(*args, clip_vloss=True)
    _, plain = losses(*args, clip_vloss=False)
    assert clipped["value_loss"].item() > plain["value_loss"].item() + 1e-3


def test_ppo_losses_masked_entries_do_not_matter():
    g = GOLD
    mask = [1, 0, 1, 1, 0, 1]
    gen = torch.Generator().manual_seed(1)
    results = []
    for trial in range(3):
        vals = {k: t64(v) for k, v in g.items()}
        if trial:
            for k in vals:
                noise = torch.randn(6, generator=gen, dtype=F64) * 3
                vals[k] = torch.where(t64(mask) > 0, vals[k], noise)
        b = PPOBatch(torch.zeros(6, 1), torch.zeros(6, 1), torch.zeros(6), vals["oldlp"], vals["adv"], vals["ret"],
                     vals["oldv"], t64(mask))
        for norm_adv in (False, True):
            loss, m = losses(vals["newlp"], vals["ent"], vals["newv"], b, 0.2, 0.5, 0.01, norm_adv=norm_adv)
            results.append((norm_adv, loss.item(), {k: v.item() for k, v in m.items()}))
    for r in results[2:]:
        ref = results[0] if r[0] is False else results[1]
        assert abs(r[1] - ref[1]) < 1e-12
        for k in ref[2]:
            assert abs(r[2][k] - ref[2][k]) < 1e-12, k


def test_ppo_losses_nonfinite_masked_entries_do_not_matter():
    g = GOLD
    mask = t64([1, 0, 1, 1, 0, 1])
    newlp = t64(g["newlp"])
    newlp[1] = 1e4  # exp(1e4 - old) overflows to inf in the excluded slot
    adv = t64(g["adv"])
    adv[4] = float("nan")
    b = PPOBatch(torch.zeros(6, 1), torch.zeros(6, 1), torch.zeros(6), t64(g["oldlp"]), adv, t64(g["ret"]),
                 t64(g["oldv"]), mask)
    loss, m = losses(newlp, t64(g["ent"]), t64(g["newv"]), b, 0.2, 0.5, 0.01, norm_adv=True)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in m.values())


def test_ppo_losses_gradient_zero_on_clipped_side():
    # sample 0: adv > 0 and ratio 1.5 > 1.2 -> no gradient; sample 1: ratio 0.9 inside -> gradient -adv*ratio/n
    newlp = t64([math.log(1.5), math.log(0.9)]).requires_grad_(True)
    b = _batch([0.0, 0.0], [2.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0])
    loss, _ = losses(newlp, t64([0.0, 0.0]), t64([0.0, 0.0]), b, 0.2, 0.5, 0.0, norm_adv=False)
    loss.backward()
    assert newlp.grad[0].item() == 0.0
    assert abs(newlp.grad[1].item() - (-1.0 * 0.9 / 2)) < 1e-9


def test_masked_mean_and_explained_variance():
    x = t64([1.0, 2.0, 3.0, 100.0])
    m = t64([1, 1, 1, 0])
    assert masked_mean(x, m).item() == 2.0
    assert masked_mean(x, torch.zeros(4, dtype=F64)).item() == 0.0
    target = t64([1.0, 2.0, 4.0, 8.0, -3.0])
    pred = t64([1.5, 2.0, 3.0, 9.0, 50.0])
    mask = t64([1, 1, 1, 1, 0])
    tt, pp = np.array([1.0, 2.0, 4.0, 8.0]), np.array([1.5, 2.0, 3.0, 9.0])
    exp = 1 - np.var(tt - pp) / np.var(tt)
    assert abs(explained_variance(pred, target, mask).item() - exp) < 1e-12
    assert explained_variance(target, target, mask).item() == 1.0
    # constant target: defined as 0
    assert explained_variance(pred, torch.ones(5, dtype=F64), mask).item() == 0.0


# ================================================================================================
# ppo_update
# ================================================================================================

SPACES = {
    "discrete": Discrete(4),
    "multi": MultiDiscrete((3, 5, 2)),
    "box": Box((-1.0, -2.0), (1.0, 2.0), (2,)),
}


def _model_batch(kind: str, seed: int = 0, B: int = 64, obs_dim: int = 5):
    torch.manual_seed(seed)
    model = MLPActorCritic(obs_dim, SPACES[kind], hidden=(16, 16))
    g = torch.Generator().manual_seed(seed + 100)
    obs = torch.randn(B, obs_dim, generator=g)
    with torch.no_grad():
        actions, logp = model.act(obs, g)
        values = model.value(obs)
    batch = PPOBatch(
        obs=obs, critic_obs=obs, actions=actions, logprobs=logp,
        advantages=torch.randn(B, generator=g), returns=values + torch.randn(B, generator=g),
        values=values, mask=(torch.rand(B, generator=g) < 0.9).float(),
    )
    return model, batch


def _fn(model):
    return lambda part: (*model.evaluate(part.obs, part.actions), model.value(part.critic_obs))


KW = dict(clip_coef=0.2, vf_coef=0.5, ent_coef=0.01, max_grad_norm=0.5)


@pytest.mark.parametrize("kind", list(SPACES))
def test_ppo_update_changes_all_params_and_lowers_loss(kind):
    model, batch = _model_batch(kind)
    fn = _fn(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if kind == "box":
        assert "head.log_std" in names
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        loss0, m0 = losses(*fn(batch), batch, KW["clip_coef"], KW["vf_coef"], KW["ent_coef"])
    assert m0["approx_kl"].abs().item() < 1e-6  # logprobs came from the same model
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    metrics = update(fn, model, opt, batch, num_epochs=1, num_minibatches=1, **KW,
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss1, _ = losses(*fn(batch), batch, KW["clip_coef"], KW["vf_coef"], KW["ent_coef"])
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), f"{n} did not change"
    assert loss1.item() < loss0.item()
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "loss", "grad_norm",
              "explained_variance", "nonfinite", "epochs"):
        assert k in metrics and torch.is_tensor(metrics[k]) and metrics[k].dim() == 0, k
        assert torch.isfinite(metrics[k]), k
    # the single step saw the batch before any change: metrics equal the pre-update losses
    assert abs(metrics["loss"].item() - loss0.item()) < 1e-5
    assert abs(metrics["approx_kl"].item()) < 1e-6
    assert metrics["clip_fraction"].item() == 0.0
    assert metrics["grad_norm"].item() > 0
    assert metrics["nonfinite"].item() == 0.0 and metrics["epochs"].item() == 1.0


@pytest.mark.parametrize("kind", ["discrete", "box"])
def test_ppo_update_reports_unclipped_grad_norm_and_clips(kind):
    model, batch = _model_batch(kind, seed=1)
    ref = copy.deepcopy(model)
    loss, _ = losses(*_fn(ref)(batch), batch, KW["clip_coef"], KW["vf_coef"], KW["ent_coef"])
    loss.backward()
    gn = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())).item()
    max_norm = gn / 10
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1.0)
    metrics = update(_fn(model), model, opt, batch, num_epochs=1, num_minibatches=1,
                         clip_coef=0.2, vf_coef=0.5, ent_coef=0.01, max_grad_norm=max_norm)
    assert abs(metrics["grad_norm"].item() - gn) < 1e-4 * gn
    # Adam's first moment after one step is (1 - beta1) x the gradient it was given: the clipped one.
    applied = torch.cat([opt.state[p]["exp_avg"].flatten() for p in params]) / 0.1
    assert abs(applied.norm().item() - max_norm) < 1e-3 * max_norm


def test_ppo_update_explained_variance_metric():
    model, batch = _model_batch("discrete", seed=2)
    params = list(model.parameters())
    metrics = update(_fn(model), model, torch.optim.Adam(params, lr=1e-3), batch, num_epochs=1,
                         num_minibatches=2, **KW)
    m = batch.mask.numpy() > 0
    ret, val = batch.returns.numpy()[m].astype(np.float64), batch.values.numpy()[m].astype(np.float64)
    exp = 1 - np.var(ret - val) / np.var(ret)
    assert abs(metrics["explained_variance"].item() - exp) < 1e-5


def test_ppo_update_minibatches_cover_batch_each_epoch():
    model, batch = _model_batch("discrete", seed=3, B=24)
    batch.obs = batch.obs.clone()
    batch.obs[:, 0] = torch.arange(24, dtype=torch.float32)  # tag rows
    seen = []
    inner = _fn(model)

    def fn(part):
        seen.append(part.obs[:, 0].long().tolist())
        return inner(part)

    params = list(model.parameters())
    update(fn, model, torch.optim.Adam(params, lr=1e-4), batch, num_epochs=2, num_minibatches=4, **KW,
               generator=torch.Generator().manual_seed(0))
    assert len(seen) == 8 and all(len(s) == 6 for s in seen)
    for e in range(2):
        assert sorted(sum(seen[4 * e:4 * e + 4], [])) == list(range(24))
    assert sum(seen[:4], []) != sum(seen[4:], [])  # reshuffled each epoch


def test_ppo_update_multi_epoch_kl_and_target_kl_early_stop():
    model, batch = _model_batch("discrete", seed=4)
    m2 = copy.deepcopy(model)
    params = list(model.parameters())
    full = update(_fn(model), model, torch.optim.Adam(params, lr=3e-3), batch, num_epochs=4, num_minibatches=4,
                      **KW, generator=torch.Generator().manual_seed(0))
    assert full["epochs"].item() == 4.0
    assert full["approx_kl"].item() > 0
    p2 = list(m2.parameters())
    early = update(_fn(m2), m2, torch.optim.Adam(p2, lr=3e-3), batch, num_epochs=4, num_minibatches=4,
                       **KW, target_kl=1e-12, generator=torch.Generator().manual_seed(0))
    assert early["epochs"].item() == 1.0


def test_ppo_update_deterministic_with_generator():
    outs = []
    for _ in range(2):
        model, batch = _model_batch("multi", seed=5)
        params = list(model.parameters())
        met = update(_fn(model), model, torch.optim.Adam(params, lr=1e-3), batch, num_epochs=2,
                         num_minibatches=4, **KW, generator=torch.Generator().manual_seed(7))
        outs.append((torch.cat([p.detach().flatten() for p in params]), met))
    assert torch.equal(outs[0][0], outs[1][0])
    for k in outs[0][1]:
        assert torch.equal(outs[0][1][k], outs[1][1][k]), k


# ================================================================================================
# Distributions and action heads
# ================================================================================================

def test_categorical_gumbel_frequencies_match_softmax():
    logits = torch.tensor([0.5, -1.0, 1.2, 0.0, -0.3])
    n = 20000
    g = torch.Generator().manual_seed(0)
    samples = D.categorical_sample(logits.expand(n, 5), g)
    counts = torch.bincount(samples, minlength=5).double()
    expected = torch.softmax(logits.double(), -1) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 25.0, chi2  # 4 dof: p(chi2 > 25) ~ 5e-5
    assert counts.sum().item() == n


def test_categorical_sampling_uses_only_the_generator():
    logits = torch.randn(200, 6)
    state = torch.get_rng_state()
    a = D.categorical_sample(logits, torch.Generator().manual_seed(11))
    b = D.categorical_sample(logits, torch.Generator().manual_seed(11))
    c = D.categorical_sample(logits, torch.Generator().manual_seed(12))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    x = D.gaussian_sample(torch.zeros(50, 3), torch.zeros(3), torch.Generator().manual_seed(1))
    y = D.gaussian_sample(torch.zeros(50, 3), torch.zeros(3), torch.Generator().manual_seed(1))
    assert torch.equal(x, y)
    assert torch.equal(torch.get_rng_state(), state)


def test_categorical_log_prob_and_entropy_match_torch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 3, 5, generator=g, dtype=F64) * 2
    actions = torch.randint(0, 5, (7, 3), generator=g)
    ref = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(D.categorical_log_prob(logits, actions), ref.log_prob(actions), atol=1e-12)
    assert torch.allclose(D.categorical_entropy(logits), ref.entropy(), atol=1e-12)


def test_gaussian_log_prob_and_entropy_match_torch():
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(10, 3, generator=g, dtype=F64)
    log_std = t64([-0.5, 0.0, 0.7])
    actions = torch.randn(10, 3, generator=g, dtype=F64) * 2
    ref = torch.distributions.Normal(mean, log_std.exp())
    assert torch.allclose(D.gaussian_log_prob(mean, log_std, actions), ref.log_prob(actions).sum(-1), atol=1e-12)
    assert torch.allclose(D.gaussian_entropy(mean, log_std), ref.entropy().sum(-1), atol=1e-12)
    # sampling statistics: mean and std per dimension
    s = D.gaussian_sample(torch.zeros(20000, 3, dtype=F64), log_std, torch.Generator().manual_seed(4))
    assert torch.allclose(s.mean(0), torch.zeros(3, dtype=F64), atol=0.05)
    assert torch.allclose(s.std(0), log_std.exp(), rtol=0.03)


@pytest.mark.parametrize("nvec", [(3, 5, 2), (4, 4)])
def test_multi_discrete_head_log_prob_entropy_and_sampling(nvec):
    head = ActionHead(MultiDiscrete(nvec))
    g = torch.Generator().manual_seed(5)
    B = 4000
    flat = torch.randn(B, sum(nvec), generator=g) * 2
    actions = head.sample(flat, g, greedy=False)
    assert actions.shape == (B, len(nvec))
    offs = [sum(nvec[:i]) for i in range(len(nvec))]
    for i, n in enumerate(nvec):
        assert int(actions[:, i].min()) >= 0 and int(actions[:, i].max()) < n  # padding never sampled
        assert set(actions[:, i].tolist()) == set(range(n))
    exp_lp = sum(torch.distributions.Categorical(logits=flat[:, o:o + n]).log_prob(actions[:, i])
                 for i, (o, n) in enumerate(zip(offs, nvec)))
    exp_ent = sum(torch.distributions.Categorical(logits=flat[:, o:o + n]).entropy() for o, n in zip(offs, nvec))
    assert torch.allclose(head.log_prob(flat, actions), exp_lp, atol=1e-5)
    assert torch.allclose(head.entropy(flat), exp_ent, atol=1e-5)
    greedy = head.sample(flat, None, greedy=True)
    for i, (o, n) in enumerate(zip(offs, nvec)):
        assert torch.equal(greedy[:, i], flat[:, o:o + n].argmax(-1))


@pytest.mark.parametrize("space", [Discrete(4), MultiDiscrete((3, 5, 2)), MultiDiscrete((2, 4), gates=((1, 0, 1),)),
                                   Box(-1.0, 1.0, (3,))], ids=["discrete", "multi", "gated", "box"])
def test_log_prob_entropy_is_log_prob_and_entropy_in_one_pass(space):
    head = ActionHead(space)
    g = torch.Generator().manual_seed(3)
    out = torch.randn(64, head.out_dim, generator=g, requires_grad=True)
    actions = head.sample(out.detach(), g, greedy=False)
    lp, ent = head.log_prob_entropy(out, actions)
    assert torch.equal(lp, head.log_prob(out, actions)) and torch.equal(ent, head.entropy(out))
    (g1,) = torch.autograd.grad((lp - 0.01 * ent).sum(), out)
    (g2,) = torch.autograd.grad((head.log_prob(out, actions) - 0.01 * head.entropy(out)).sum(), out)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-6)  # one softmax backward sums what two did apart


@pytest.mark.parametrize("rows", [4, 256, 1024])
def test_fast_tanh_is_tanh_in_value_and_gradient_at_every_size(rows):
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows), requires_grad=True) * 3
    y = FastTanh()(x)
    torch.testing.assert_close(y, torch.tanh(x), rtol=0, atol=3e-7)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, 1 - torch.tanh(x) ** 2, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(FastTanh()(x), y, rtol=0, atol=0)  # inference computes what training does


def test_rational_tanh_is_tanh_over_the_whole_line():
    x = torch.cat([torch.linspace(-20, 20, 400_001), torch.tensor([float("inf"), -float("inf"), 0.0, 1e-30])])
    y = _rational_tanh(x)
    torch.testing.assert_close(y, torch.tanh(x), rtol=0, atol=3.5e-7)
    assert y.abs().max() <= 1.0 and y[-1] == 1e-30  # never beyond +-1; tiny inputs keep their value
    assert _rational_tanh(torch.tensor([float("nan")])).isnan().all()


def test_compiled_inference_fast_tanh_is_the_rational_tanh_and_training_keeps_the_gradient():
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(5), requires_grad=True) * 3
    tanh = torch.compile(FastTanh(), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(tanh(x.detach()), _rational_tanh(x), rtol=0, atol=0)  # a compiled rollout's form
    y = tanh(x)  # training: the sigmoid form, compiled as eager runs it
    torch.testing.assert_close(y, FastTanh()(x), rtol=0, atol=2e-7)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, 1 - torch.tanh(x) ** 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 4), (2048, 4), (1024, 3, 6), (2048, 32)], ids=["small", "narrow", "agents", "wide"])
def test_linear_computes_what_nn_linear_does_forward_and_backward(shape):
    g = torch.Generator().manual_seed(shape[0])
    layer = Linear(shape[-1], 64)
    plain = nn.Linear(shape[-1], 64)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(*shape, generator=g, requires_grad=True)
    grad = torch.randn(*shape[:-1], 64, generator=g)
    y = layer(x)
    narrow = shape[-1] <= NARROW_INPUT_MAX_FEATURES and x.numel() >= NARROW_WEIGHT_GRAD_MIN_ROWS * shape[-1]
    assert ("LinearFunction" in type(y.grad_fn).__name__) == narrow  # the narrow way exactly where it pays
    assert torch.equal(y, plain(x))  # the forward inference runs, bit for bit
    gx, gw, gb = torch.autograd.grad(y, (x, layer.weight, layer.bias), grad)
    px, pw, pb = torch.autograd.grad(plain(x), (x, plain.weight, plain.bias), grad)
    assert torch.equal(gx, px) and torch.equal(gb, pb)
    torch.testing.assert_close(gw, pw, rtol=1e-5, atol=1e-4)  # the same sums in another order
    layer(x).backward(grad)
    assert layer.weight.grad.is_contiguous()  # as the optimizer's fused kernel reads it


@pytest.mark.parametrize("out", [1, 2])
def test_compiled_narrow_output_linear_computes_what_nn_linear_does(out):
    g = torch.Generator().manual_seed(out)
    layer, plain = Linear(64, out), nn.Linear(64, out)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(1024, 64, generator=g, requires_grad=True)
    grad = torch.randn(1024, out, generator=g)

    def grads(module: nn.Module) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(module(x), (x, module.weight, module.bias), grad)

    compiled = torch.compile(grads, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        ours = compiled(layer)  # broadcast products and sums (is_compiling)
    for a, b in zip(ours, grads(plain)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_linear_under_bf16_autocast_computes_what_nn_linear_does():
    g = torch.Generator().manual_seed(11)
    layer, plain = Linear(4, 64), nn.Linear(4, 64)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2048, 4, generator=g, requires_grad=True)
    grad = torch.randn(2048, 64, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, p = layer(x), plain(x)
    assert y.dtype == p.dtype == torch.bfloat16 and torch.equal(y, p)
    ours = torch.autograd.grad(y, (x, layer.weight, layer.bias), grad)
    theirs = torch.autograd.grad(p, (x, plain.weight, plain.bias), grad)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)  # bfloat16 sums of 2048 rows, in another order


def test_multi_discrete_padding_never_sampled_even_when_valid_logits_are_tiny():
    nvec = (2, 6)
    head = ActionHead(MultiDiscrete(nvec))
    flat = torch.full((5000, 8), -80.0)  # valid logits very negative, padding must still lose
    a = head.sample(flat, torch.Generator().manual_seed(0), greedy=False)
    assert int(a[:, 0].max()) < 2
    assert torch.isfinite(head.entropy(flat)).all()
    assert torch.allclose(head.entropy(flat), torch.full((5000,), math.log(2) + math.log(6)), atol=1e-5)


def test_multi_discrete_frequencies_match_per_head_softmax():
    nvec = (3, 2)
    head = ActionHead(MultiDiscrete(nvec))
    logits = torch.tensor([0.3, -1.0, 1.0, 0.5, -0.5])
    n = 20000
    a = head.sample(logits.expand(n, 5), torch.Generator().manual_seed(9), greedy=False)
    for i, (o, k) in enumerate([(0, 3), (3, 2)]):
        counts = torch.bincount(a[:, i], minlength=k).double()
        exp = torch.softmax(logits[o:o + k].double(), -1) * n
        assert (((counts - exp) ** 2) / exp).sum().item() < 25.0


def test_gaussian_head_to_env_clips_per_dimension_bounds():
    head = ActionHead(Box((-1.0, -2.0), (1.0, 2.0), (2,)), init_log_std=-0.5)
    a = torch.tensor([[5.0, 5.0], [-5.0, -5.0], [0.5, -1.5], [1.0, 2.0]])
    assert torch.equal(head.to_env(a), torch.tensor([[1.0, 2.0], [-1.0, -2.0], [0.5, -1.5], [1.0, 2.0]]))
    assert torch.allclose(head.log_std.detach(), torch.full((2,), -0.5))
    out = torch.zeros(3, 2)
    assert torch.equal(head.sample(out, None, greedy=True), out)
    # discrete heads pass actions through unchanged
    d = ActionHead(Discrete(3))
    x = torch.tensor([0, 2, 1])
    assert torch.equal(d.to_env(x), x)


@pytest.mark.parametrize("kind", list(SPACES))
def test_mlp_actor_critic_batch_axes(kind):
    space = SPACES[kind]
    model = MLPActorCritic(4, space, hidden=(8,), num_agents=2, state_dim=6)
    obs = torch.randn(3, 2, 4)
    g = torch.Generator().manual_seed(0)
    a, lp = model.act(obs, g)
    assert a.shape == (3, 2) + tuple(space.shape) if kind != "box" else a.shape == (3, 2, 2)
    assert lp.shape == (3, 2)
    lp2, ent = model.evaluate(obs, a)
    assert torch.allclose(lp, lp2) and ent.shape == (3, 2)
    assert model.value(torch.randn(3, 6)).shape == (3, 2)  # centralised: the state, one value per agent


# ================================================================================================
# Normalisers
# ================================================================================================

def _expected_stats(data: np.ndarray, c0: float = 1e-4):
    """Mean/var of `data` (rows) merged with the prior pseudo-sample (count c0, mean 0, var 1)."""
    n = data.shape[0]
    if n == 0:
        return np.zeros(data.shape[1:]), np.ones(data.shape[1:])
    m = data.mean(0)
    tot = c0 + n
    mean = m * n / tot
    m2 = c0 * 1.0 + ((data - m) ** 2).sum(0) + m ** 2 * c0 * n / tot
    return mean, m2 / tot


def test_running_mean_std_matches_numpy_over_batches():
    rms = RunningMeanStd((3,))
    rng = np.random.default_rng(0)
    chunks = []
    for i, n in enumerate([5, 17, 1, 40]):
        x = rng.normal(loc=[1.0, -2.0, 5.0], scale=[0.5, 2.0, 3.0], size=(n, 3)).astype(np.float32)
        chunks.append(x.astype(np.float64))
        rms.update(torch.from_numpy(x))
        mean, var = _expected_stats(np.concatenate(chunks))
        assert np.allclose(rms.mean.numpy(), mean, rtol=1e-10, atol=1e-12), i
        assert np.allclose(rms.var.numpy(), var, rtol=1e-10, atol=1e-12), i
    allx = np.concatenate(chunks)
    assert np.allclose(rms.mean.numpy(), allx.mean(0), rtol=1e-4)
    assert np.allclose(rms.var.numpy(), allx.var(0), rtol=1e-4)
    assert abs(rms.count.item() - (63 + 1e-4)) < 1e-9


def test_running_mean_std_with_masks_and_batch_axes():
    rms = RunningMeanStd((2,))
    rng = np.random.default_rng(1)
    kept = []
    for n in (4, 6, 3):
        x = rng.normal(size=(n, 3, 2)).astype(np.float32) * 2 + 1
        mask = rng.random((n, 3)) < 0.6
        mask[0, 0] = True
        x[~mask] = 1e6  # excluded rows must not count
        kept.append(x[mask].astype(np.float64))
        rms.update(torch.from_numpy(x), torch.from_numpy(mask))
        mean, var = _expected_stats(np.concatenate(kept))
        assert np.allclose(rms.mean.numpy(), mean, rtol=1e-9)
        assert np.allclose(rms.var.numpy(), var, rtol=1e-9)
    snap = {k: v.clone() for k, v in rms.state_dict().items()}
    rms.update(torch.full((5, 3, 2), 123.0), torch.zeros(5, 3, dtype=torch.bool))
    for k, v in rms.state_dict().items():
        assert torch.equal(v, snap[k]), k
    # all-masked as the very first update also leaves the initial statistics
    fresh = RunningMeanStd((2,))
    fresh.update(torch.randn(4, 2), torch.zeros(4))
    assert torch.equal(fresh.mean, torch.zeros(2, dtype=F64)) and torch.equal(fresh.var, torch.ones(2, dtype=F64))
    assert fresh.count.item() == 1e-4


def test_running_mean_std_nonfinite_masked_rows_ignored():
    rms = RunningMeanStd((2,))
    x = torch.tensor([[1.0, 2.0], [float("inf"), float("nan")], [3.0, 4.0]])
    rms.update(x, torch.tensor([True, False, True]))
    assert torch.isfinite(rms.mean).all() and torch.isfinite(rms.var).all()


def test_running_mean_std_normalize_roundtrip_and_clip():
    rms = RunningMeanStd((2,))
    rms.update(torch.tensor([[0.0, 10.0], [2.0, 30.0], [4.0, 50.0]]))
    x = torch.tensor([[1.0, 20.0], [100.0, -100.0]])
    y = rms.normalize(x)
    exp = (x.double() - rms.mean) / torch.sqrt(rms.var + 1e-8)
    assert torch.allclose(y.double(), exp, atol=1e-5)
    assert torch.allclose(rms.denormalize(y), x, atol=1e-3)
    assert rms.normalize(x, clip=5.0).abs().max().item() == 5.0


def test_reward_scaler_divides_by_std_of_discounted_return():
    gamma, N, T = 0.9, 4, 30
    rng = np.random.default_rng(2)
    rewards = rng.normal(0.5, 1.0, size=(T, N)).astype(np.float32)
    dones = rng.random((T, N)) < 0.1
    active = rng.random((T, N)) < 0.85
    scaler = RewardScaler((N,), gamma)
    ret = np.zeros(N)
    seen = []
    for t in range(T):
        ret = ret * gamma + rewards[t]
        seen.append(ret[active[t]].copy())
        _, var = _expected_stats(np.concatenate(seen)[:, None])
        exp = np.clip(rewards[t] / np.sqrt(var[0] + 1e-8), -10.0, 10.0)
        got = scaler(torch.from_numpy(rewards[t]), torch.from_numpy(dones[t]), torch.from_numpy(active[t]))
        assert np.allclose(got.numpy(), exp, rtol=1e-4, atol=1e-5), t
        ret[dones[t]] = 0.0
    # the discounted-return std is used, not the reward std
    assert abs(scaler.stats.var.item() - np.concatenate(seen).var()) < 1e-3 * np.concatenate(seen).var()


def test_reward_scaler_clips():
    scaler = RewardScaler((1,), 0.99)
    out = scaler(torch.tensor([1.0]), torch.tensor([False]), torch.tensor([True]), clip=10.0)
    # after one sample the variance is tiny (prior count 1e-4) so the scaled reward hits the clip
    assert out.item() == 10.0
    # returns {1, 1e6 - 0.99}: std ~ 5e5, so -1e6 scales to about -2 and a clip of 1.5 applies
    out = scaler(torch.tensor([1e6]), torch.tensor([False]), torch.tensor([True]), clip=1.5)
    assert out.item() == 1.5


def test_gated_sub_action_carries_no_log_prob_or_gradient_when_off():
    space = MultiDiscrete((4, 2), gates=((0, 1, 1),))
    head = ActionHead(space)
    out = torch.randn(5, 6, requires_grad=True)
    off = torch.tensor([[2, 0]] * 5)  # head 1 == 0: head 0 is ignored by the env
    on = torch.tensor([[2, 1]] * 5)
    lp_off = head.log_prob(out, off)
    expect_off = torch.log_softmax(out[:, 4:], -1)[:, 0]
    assert torch.allclose(lp_off, expect_off)
    lp_off.sum().backward()
    assert out.grad[:, :4].abs().sum() == 0  # no gradient into the ignored target head
    lp_on = head.log_prob(out.detach(), on)
    expect_on = torch.log_softmax(out.detach()[:, :4], -1)[:, 2] + torch.log_softmax(out.detach()[:, 4:], -1)[:, 1]
    assert torch.allclose(lp_on, expect_on)
    p_on = torch.softmax(out.detach()[:, 4:], -1)[:, 1]
    ent = head.entropy(out.detach())
    h0 = torch.distributions.Categorical(logits=out.detach()[:, :4]).entropy()
    h1 = torch.distributions.Categorical(logits=out.detach()[:, 4:]).entropy()
    assert torch.allclose(ent, h1 + p_on * h0, atol=1e-6)


def test_gae_is_a_parallel_scan_matching_the_reference_on_long_rollouts():
    """No per-step launches: 16x longer rollouts add only log2(T) scan rounds of torch calls, and
    the scan equals the step-by-step reference."""
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Calls.n += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for T in (16, 256):
        g = torch.Generator().manual_seed(T)
        r, v, nv = (torch.randn(T, 3, generator=g, dtype=F64) for _ in range(3))
        term, trunc = torch.rand(T, 3, generator=g) < 0.05, torch.rand(T, 3, generator=g) < 0.05
        active, te = torch.rand(T, 3, generator=g) < 0.8, torch.rand(T, 3, generator=g) < 0.05
        Calls.n = 0
        with Calls():
            adv, _ = compute_gae(r, v, nv, term, trunc, 0.99, 0.95, active=active, trial_end=te, trial_bootstrap="continue")
        counts[T] = Calls.n
        for n in range(3):
            col = lambda x: x[:, n].tolist()  # noqa: E731
            exp = forward_reference(col(r), col(v), col(nv), col(term), col(trunc), col(active), col(te), 0.99, 0.95, False)
            assert torch.allclose(adv[:, n], t64(exp), atol=1e-9)
    assert counts[256] - counts[16] <= 4 * 3 * 8, counts  # 4 more rounds in each of 3 scans


@pytest.mark.parametrize("form", ["fused", "foreach", "per_tensor"])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_adam_steps_as_torch_adam_does(form, tensor_lr):
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(5, 3, generator=g), torch.randn(3, generator=g)]
    theirs = [p.clone().requires_grad_() for p in ours]
    opt = Adam(ours, lr=torch.tensor(3e-3) if tensor_lr else 3e-3, betas=(0.8, 0.99), eps=1e-5)
    ref = torch.optim.Adam(theirs, lr=3e-3, betas=(0.8, 0.99), eps=1e-5)
    for _ in range(50):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        adam_update(opt, grads, form)
        for p, gr in zip(theirs, grads):
            p.grad = gr.clone()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-6, atol=0)
    assert all(float(opt.state[p]["step"]) == 50 for p in ours)


@pytest.mark.parametrize("form", ["fused", "foreach", "per_tensor"])
def test_adam_marks_the_parameters_changed(form):
    """Every form bumps the parameters' version counters, as an in-place op does: torch's fused kernel
    alone did not, so autograd and the rollout's packed weights could not tell the parameters changed."""
    params = [torch.randn(4, 3), torch.randn(3)]
    opt = Adam(params, lr=1e-2)
    before = [p._version for p in params]
    adam_update(opt, [torch.ones_like(p) for p in params], form)
    assert all(p._version > v for p, v in zip(params, before))


@pytest.mark.parametrize("space", [Discrete(3), Box.uniform(-1.0, 1.0, (2,))], ids=["discrete", "box"])
@pytest.mark.parametrize("agent_id", [False, True])
def test_packed_act_value_is_act_and_value_through_updates_and_loads(space, agent_id):
    """The rollout's act_value runs actor and critic as one packed MLP on small CPU batches: the same
    actions, log-probs and values as `act` and `value`, after an optimizer step and a load_state_dict too
    (the packed weights are cached)."""
    torch.manual_seed(0)
    model = MLPActorCritic(6, space, (32, 16), "tanh", num_agents=2, agent_id=agent_id)
    obs = torch.randn(4, 2, 6)

    def agree() -> None:
        with torch.no_grad():
            assert model._packed_inference(obs)
            a, lp, v = model.act_value(obs, torch.Generator().manual_seed(5))
            a_ref, lp_ref = model.act(obs, torch.Generator().manual_seed(5))
            v_ref = model.value(obs)
        torch.testing.assert_close(a, a_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-6)

    agree()
    opt = Adam(list(model.parameters()), lr=0.5)
    for form in ("fused", "foreach"):
        adam_update(opt, [torch.randn_like(p) for p in model.parameters()], form)
        agree()
    other = MLPActorCritic(6, space, (32, 16), "tanh", num_agents=2, agent_id=agent_id)
    model.load_state_dict(other.state_dict())
    agree()
    with torch.no_grad():
        model.critic[0].weight.mul_(3.0)
    agree()


def test_categorical_sample_draws_what_the_clamped_gumbel_form_drew():
    """Gumbel-max as logits - log(-log u): the same actions as logits + (-log(clamp(-log(clamp(u))))), the
    form it replaced, for every u but exactly 0."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2048, 5, generator=g) * 3
    u = torch.rand(2048, 5, generator=torch.Generator().manual_seed(9))
    gumbel = -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))
    clamped = (logits + gumbel).argmax(-1)
    assert torch.equal(D.categorical_sample(logits, torch.Generator().manual_seed(9)), clamped)


def test_adam_state_dict_round_trip_restores_the_trajectory():
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(4, generator=g)]
    grads = [[torch.randn(4, generator=g)] for _ in range(6)]
    opt = Adam(params, lr=torch.tensor(1e-2))
    for gr in grads[:3]:
        adam_update(opt, gr)
    saved, start = copy.deepcopy(opt.state_dict()), params[0].clone()
    for gr in grads[3:]:
        adam_update(opt, gr)
    first = params[0].clone()
    opt.param_groups[0]["lr"].fill_(0.5)  # the saved learning rate comes back too
    params[0].copy_(start)
    opt.load_state_dict(saved)
    for gr in grads[3:]:
        adam_update(opt, gr)
    assert torch.equal(params[0], first)


def test_training_never_imports_dynamo(tmp_path):
    """Any torch.optim optimizer imports torch._dynamo when created (2.3 s on a 2-core CPU); a run without
    --compile must not pay it."""
    code = ("import sys; from phalanx.config import resolve; from phalanx.trainer import Trainer\n"
            f"t = Trainer(resolve(dict(env='cartpole', num_envs=8, num_steps=8, device='cpu', progress=False, "
            f"tensorboard=False, run_dir={str(tmp_path / 'r')!r})))\n"
            "t.collect(); t.update(); t.save(); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("clip_vloss", [True, False])
def test_losses_without_a_mask_equal_those_with_an_all_ones_mask_bit_for_bit(clip_vloss):
    """The CPU trainer drops the mask where every sample is active (no test in each mean): the losses, their
    gradients and every metric must be what the all-ones mask gives, exactly."""
    g = torch.Generator().manual_seed(3)
    n = 128
    cols = [torch.randn(n, generator=g) for _ in range(4)]
    full = PPOBatch(torch.zeros(n, 1), torch.zeros(n, 1), torch.zeros(n, dtype=torch.long), *cols, mask=torch.ones(n))
    none = copy.copy(full)
    none.mask = None
    hp = ppo_params(clip_vloss=clip_vloss, ent_coef=0.01)
    grads, out = [], []
    for batch in (full, none):
        newlp, ent, newv = (torch.randn(n, generator=torch.Generator().manual_seed(k)).requires_grad_() for k in (5, 6, 7))
        loss, metrics = ppo_losses(newlp, ent, newv, batch, hp)
        loss.backward()
        grads.append([t.grad for t in (newlp, ent, newv)])
        out.append({"loss": loss.detach(), **metrics})
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0]), {k: (out[0][k], out[1][k]) for k in out[0]}
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert torch.equal(explained_variance(cols[3], cols[2], full.mask), explained_variance(cols[3], cols[2], None))
    assert len(none.index(torch.arange(0, n, 2))) == n // 2 and none.index(torch.arange(4)).mask is None


@pytest.mark.parametrize("rows", [64, 4096])
def test_minibatch_gather_picks_the_same_rows_however_it_gathers(rows):
    """PPOBatch.index gathers a [B, 1] column as a vector from VECTOR_GATHER_MIN_ROWS rows on: the same
    values, shapes and dtypes as a row gather, for every field (masked, with memory rows)."""
    g = torch.Generator().manual_seed(3)
    n = 2 * rows
    col = lambda dtype=torch.float32: torch.randn(n, 1, generator=g).to(dtype)  # noqa: E731
    obs = torch.randn(n, 1, 5, generator=g)
    batch = PPOBatch(obs=obs, critic_obs=torch.randn(n, 7, generator=g), actions=col(torch.long), logprobs=col(),
                     advantages=col(), returns=col(), values=col(), mask=col(), rows=torch.arange(n), resets=col(torch.bool),
                     env_active=torch.randn(n, 3, generator=g) > 0)
    idx = torch.randperm(n, generator=g)[:rows]
    part = batch.index(idx)
    assert (rows >= VECTOR_GATHER_MIN_ROWS) == (rows == 4096)
    for name in ("obs", "critic_obs", "actions", "logprobs", "advantages", "returns", "values", "mask", "rows", "resets", "env_active"):
        got, full = getattr(part, name), getattr(batch, name)
        want = full[idx]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


def test_trial_ends_without_a_trial_bootstrap_rule_are_refused():
    """The rule's one default is the config's (trial_bootstrap); the pure functions take it where trial ends are given."""
    z = torch.zeros(3, 2)
    no = torch.zeros(3, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="trial_bootstrap must be 'continue' or 'stop' where trial ends are given"):
        compute_gae(z, z, z, no, no, 0.99, 0.95, trial_end=no)
    with pytest.raises(ValueError, match="trial_bootstrap"):
        pending_bootstrap(~no, no, no, torch.ones(2, dtype=torch.bool), trial_end=no)
    compute_gae(z, z, z, no, no, 0.99, 0.95)  # without trial ends the rule does not matter


def test_trained_rows_drop_the_untrained_and_leave_the_losses_as_they_were():
    """A turn-based learner's batch is half turns it sat out: `PPOBatch.trained_rows` keeps only the rows that train,
    in order, and the losses of what is left, unmasked, are the masked losses of the whole batch."""
    g = GOLD
    mask = [1, 0, 1, 1, 0, 1]
    full = PPOBatch(torch.arange(6, dtype=F64).unsqueeze(1), torch.arange(6, dtype=F64).unsqueeze(1),
                    torch.arange(6), t64(g["oldlp"]), t64(g["adv"]), t64(g["ret"]), t64(g["oldv"]), t64(mask))
    part = full.trained_rows()
    kept = [i for i, m in enumerate(mask) if m]
    assert part.mask is None and part.actions.tolist() == kept and part.obs[:, 0].tolist() == kept
    assert part.critic_obs[:, 0].tolist() == kept
    for norm_adv in (False, True):
        whole, m_whole = losses(t64(g["newlp"]), t64(g["ent"]), t64(g["newv"]), full, 0.2, 0.5, 0.01, norm_adv=norm_adv)
        index = torch.tensor(kept)
        left, m_left = losses(t64(g["newlp"])[index], t64(g["ent"])[index], t64(g["newv"])[index], part, 0.2, 0.5, 0.01,
                              norm_adv=norm_adv)
        assert abs(whole.item() - left.item()) < 1e-12
        for k in m_whole:
            assert abs(m_whole[k].item() - m_left[k].item()) < 1e-12, k
    # Rows with an agent axis: a row stays where any of its slots trains, and the mask stays for the others.
    two = dataclasses.replace(full, mask=torch.tensor([[1, 0], [0, 0], [1, 1], [0, 1], [0, 0], [1, 1]], dtype=F64))
    part = two.trained_rows()
    assert part.actions.tolist() == [0, 2, 3, 5] and part.mask.tolist() == [[1, 0], [1, 1], [0, 1], [1, 1]]
    assert full.trained_rows().trained_rows().actions.tolist() == kept  # nothing left to drop
