"""Strategy-encoder actor-critic (duel): sequence forward == step replay, gradients, latent window."""

import pytest
import torch
from test_memory_models import SPACES, A, D, N, T, episode_data, replay, seq_call_names

from phalanx.envs.spaces import MultiDiscrete
from phalanx.models.memory import KVCache, LSTMState, MemorySettings
from phalanx.models.strategy import StrategyActorCritic, StrategyState

OPP = (2, D)  # the default opponent slice: the second half (rounded down) of the D features
HISTORY = 3


def make(space=SPACES["discrete"], seed=0, num_agents=A, agent_id=True, memory_critic=None, state_dim=None, **kw):
    torch.manual_seed(seed)
    kw = {"hidden": 16, "width": 16, "layers": 2, "heads": 2, "history": HISTORY, "latent_tokens": 2, **kw}
    settings = MemorySettings(D, space, num_agents=num_agents, agent_id=agent_id, memory_critic=memory_critic,
                              state_dim=state_dim)
    m = StrategyActorCritic(settings, **kw)
    with torch.no_grad():  # random parameters, large enough that every part matters
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("space", ["discrete", "multi"])
def test_sequence_forward_equals_step_replay(space):
    m = make(SPACES[space])
    assert m.opponent_features == OPP
    obs, resets, active = episode_data(2 * T)
    out, value, snap = replay(m, obs, resets, active, m.initial_state(N * A), snapshot_at=T)
    actions = m.head.sample(out, torch.Generator().manual_seed(2), greedy=False)
    step_lp = m.head.log_prob(out, actions)
    # the second segment starts mid-episode with both memories in use and the KV ring buffer wrapped
    assert int(snap.pos[0]) > HISTORY and bool(snap.valid[0].all()) and snap.h[0].abs().sum() > 0

    for s, start in [(slice(0, T), m.initial_state(N * A)), (slice(T, 2 * T), snap)]:
        before = start.clone()
        seq_out, seq_v = m.seq(obs[:, :, s], start, resets[:, :, s], active[:, :, s])
        lp, ent, v = m.evaluate_seq(obs[:, :, s], actions[:, :, s], start, resets[:, :, s], active[:, :, s])
        assert seq_out.shape == out[:, :, s].shape and lp.shape == ent.shape == v.shape == (N, A, T)
        torch.testing.assert_close(seq_out, out[:, :, s], atol=1e-5, rtol=0)
        torch.testing.assert_close(v, value[:, :, s], atol=1e-5, rtol=0)
        torch.testing.assert_close(lp, step_lp[:, :, s], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, m.head.entropy(out[:, :, s]), atol=1e-5, rtol=0)
        fast_out, fast_v = m.seq(obs[:, :, s], start, resets[:, :, s], active[:, :, s], idle_outputs=False)
        act = active[:, :, s]
        assert torch.isfinite(fast_out).all()
        torch.testing.assert_close(fast_out[act], seq_out[act], atol=1e-5, rtol=0)
        torch.testing.assert_close(fast_v[act], seq_v[act], atol=1e-5, rtol=0)
        for f in before._batch_dims:  # the sequence forward leaves start_state untouched
            assert torch.equal(getattr(before, f), getattr(start, f)), f


def test_state_views_and_step_semantics():
    m = make()
    obs, resets, active = episode_data(2 * T)
    st = m.initial_state(N * A)
    assert isinstance(st.kv, KVCache) and isinstance(st.lstm, LSTMState)
    assert st.kv.k is st.k and st.lstm.c is st.c  # views: the cores' in-place writes land in st
    replay(m, obs, resets, active, st)
    assert int(st.pos.max()) > 0 and st.valid.any() and st.h.abs().sum() > 0
    with torch.no_grad():
        before = st.clone()
        m.step(obs[:, :, 0], st, active=torch.zeros(N, A, dtype=torch.bool))  # inactive: nothing written
        v = m.value_step(obs[:, :, 1], st)  # a peek: nothing written either
        for f in before._batch_dims:
            assert torch.equal(getattr(before, f), getattr(st, f)), f
        out, v_step = m.step(obs[:, :, 1], st.clone())
        torch.testing.assert_close(v, v_step)
        out_reset, _ = m.step(obs[:, :, 1], st.clone(), reset=torch.ones(N, A, dtype=torch.bool))
        out_fresh, _ = m.step(obs[:, :, 1], m.initial_state(N * A))
        torch.testing.assert_close(out_reset, out_fresh, atol=1e-6, rtol=0)
        assert not torch.allclose(out_reset, out)
    whole = StrategyState.cat([st.select(torch.arange(3)), st.select(torch.arange(3, N * A))])
    for f in st._batch_dims:
        assert torch.equal(getattr(whole, f), getattr(st, f)), f


@pytest.mark.parametrize("centralized", [False, True])
def test_ppo_loss_gradients_reach_every_parameter(centralized):
    kw = {"state_dim": 7} if centralized else {}
    m = make(SPACES["multi"], **kw)
    obs, resets, active = episode_data(2 * T)
    _, _, snap = replay(m, obs, resets, active, m.initial_state(N * A), snapshot_at=T)
    g = torch.Generator().manual_seed(3)
    actions = torch.stack([torch.randint(0, n, (N, A, T), generator=g) for n in m.head.space.nvec], -1)
    adv, ret = torch.randn(N, A, T, generator=g), torch.randn(N, A, T, generator=g)
    s = slice(T, 2 * T)
    lp, ent, v = m.evaluate_seq(obs[:, :, s], actions, snap, resets[:, :, s], active[:, :, s], idle_outputs=False)
    if centralized:
        v = m.value(torch.randn(N, T, 7, generator=g)).transpose(1, 2)
    mask = active[:, :, s]
    loss = (-(lp * adv) + 0.5 * (v - ret) ** 2 - 0.01 * ent)[mask].mean()
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_latent_reads_the_opponent_history_window():
    """z_t depends on the opponent features of the last layers * history active steps, nothing else."""
    m = make(history=HISTORY, layers=2, num_agents=1, agent_id=False)
    window = 2 * HISTORY
    obs = torch.randn(1, 1, 12, D)
    t = 11
    latent = m.latent_seq(obs, m.initial_state(1))
    out = m.seq(obs, m.initial_state(1))[0]

    def changed(step, features):
        x = obs.clone()
        x[..., step, features] += 1.0
        return m.latent_seq(x, m.initial_state(1)), m.seq(x, m.initial_state(1))[0]

    opp = slice(*OPP)
    z, o = changed(t - 5, opp)  # within the window: the latent and the policy see it
    assert (z[..., t, :, :] - latent[..., t, :, :]).abs().max() > 1e-3
    assert (o[..., t, :] - out[..., t, :]).abs().max() > 1e-3
    z, _ = changed(t - window, opp)  # the oldest step still in the window
    assert (z[..., t, :, :] - latent[..., t, :, :]).abs().max() > 1e-3
    z, o = changed(t - window - 1, opp)  # beyond it: z_t unchanged (only the LSTM may carry it)
    torch.testing.assert_close(z[..., t, :, :], latent[..., t, :, :], atol=1e-6, rtol=0)
    assert (z[..., t - 1, :, :] - latent[..., t - 1, :, :]).abs().max() > 1e-3
    z, o = changed(slice(None), slice(0, OPP[0]))  # own features never reach the latent, but the policy
    torch.testing.assert_close(z, latent, atol=1e-6, rtol=0)
    assert (o - out).abs().max() > 1e-3


def test_no_nan_in_degenerate_segments():
    m = make(SPACES["multi"])
    obs = torch.randn(N, A, T, D)
    actions = torch.zeros(N, A, T, 3, dtype=torch.long)
    start = m.initial_state(N * A)
    cases = [
        (torch.zeros(N, A, T, dtype=torch.bool), torch.zeros(N, A, T, dtype=torch.bool)),  # all inactive
        (torch.ones(N, A, T, dtype=torch.bool), torch.ones(N, A, T, dtype=torch.bool)),  # resets every step
        (torch.ones(N, A, T, dtype=torch.bool), torch.zeros(N, A, T, dtype=torch.bool)),  # both
    ]
    for resets, active in cases:
        m.zero_grad()
        lp, ent, v = m.evaluate_seq(obs, actions, start, resets, active)
        (lp.sum() + ent.sum() + v.sum()).backward()
        assert all(torch.isfinite(x).all() for x in (lp, ent, v))
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
        out, value, _ = replay(m, obs, resets, active, m.initial_state(N * A))
        torch.testing.assert_close(m.head.log_prob(out, actions), lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(value, v.detach(), atol=1e-5, rtol=0)


def test_sequence_forward_is_batched_over_time():
    """No Python loop per step: 8x longer segments add only the LSTM's log2(T) scan rounds."""
    names = seq_call_names(make())
    assert len(names[128]) - len(names[16]) <= 60, (len(names[16]), len(names[128]))
    assert names[16].count("lstm") == names[128].count("lstm") == 1


def test_duel_defaults():
    m = StrategyActorCritic(MemorySettings(64, MultiDiscrete((2,) * 10)))
    assert m.opponent_features == (32, 64) and m.strategy.horizon == 90
    st = m.initial_state(3)
    assert st.k.shape == (3, 2, 90, 64) and st.h.shape == (3, 128)
    with pytest.raises(ValueError):
        StrategyActorCritic(MemorySettings(64, MultiDiscrete((2,) * 10)), opponent_features=(40, 70))
