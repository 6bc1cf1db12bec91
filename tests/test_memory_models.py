"""Memory actor-critics: sequence forward == step forward replayed (docs/DESIGN.md section 4)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from phalanx.envs.spaces import Box, Discrete, MultiDiscrete
from phalanx.models.memory import KVCache, LSTMActorCritic, LSTMState, MemorySettings, TransformerActorCritic

N, A, D, T = 3, 2, 5, 9  # segments of T steps; rollouts of 2 T
SPACES = {
    "discrete": Discrete(4),
    "multi": MultiDiscrete((3, 2, 4), gates=((2, 1, 1),)),
    "box": Box.uniform(-1, 1, (2,)),
}


def make(kind, space=SPACES["discrete"], seed=0, **kw):
    torch.manual_seed(seed)
    settings = MemorySettings(D, space, num_agents=A, agent_id=True, **kw)
    if kind == "lstm":
        m = LSTMActorCritic(settings, hidden=16)
    else:
        m = TransformerActorCritic(settings, width=16, layers=2, heads=2, horizon=3)
    with torch.no_grad():  # random parameters, large enough that every part matters
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


def episode_data(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(N, A, steps, D, generator=g)
    resets = torch.rand(N, A, steps, generator=g) < 0.15
    active = torch.rand(N, A, steps, generator=g) < 0.75
    resets[0, 0] = False  # slot 0 runs one long episode (longer than the horizon) ...
    resets[1, 0, 0] = resets[1, 1, 1] = True  # ... others start episodes at, near and after t = 0
    resets[2, 1, T] = True  # an episode starting exactly at the segment boundary
    active[0, 0, : T // 2 + 2] = True
    return obs, resets, active


def replay(m, obs, resets, active, state, snapshot_at=None):
    """Step forward over [N, A, steps]; returns stacked head outputs, values, and a state snapshot."""
    outs, values, snap = [], [], None
    with torch.no_grad():
        for t in range(obs.shape[2]):
            if t == snapshot_at:
                snap = state.clone()
            out, v = m.step(obs[:, :, t], state, resets[:, :, t], active[:, :, t])
            outs.append(out)
            values.append(v)
    return torch.stack(outs, 2), torch.stack(values, 2) if values[0] is not None else None, snap


@pytest.mark.parametrize("space", list(SPACES))
@pytest.mark.parametrize("kind", ["lstm", "transformer"])
def test_sequence_forward_equals_step_replay(kind, space):
    m = make(kind, SPACES[space])
    obs, resets, active = episode_data(2 * T)
    out, value, snap = replay(m, obs, resets, active, m.initial_state(N * A), snapshot_at=T)
    g = torch.Generator().manual_seed(2)
    actions = m.head.sample(out, g, greedy=False)
    step_lp, step_ent = m.head.log_prob(out, actions), m.head.entropy(out)
    if kind == "transformer":  # the second segment starts mid-episode after the cache wrapped
        assert int(snap.pos[0]) > m.horizon and bool(snap.valid[0].all())
    else:
        assert snap.h[0].abs().sum() > 0

    segments = [(slice(0, T), m.initial_state(N * A)), (slice(T, 2 * T), snap)]
    for s, start in segments:
        before = start.clone()
        seq_out, seq_v = m.seq(obs[:, :, s], start, resets[:, :, s], active[:, :, s])
        lp, ent, v = m.evaluate_seq(obs[:, :, s], actions[:, :, s], start, resets[:, :, s], active[:, :, s])
        assert seq_out.shape == out[:, :, s].shape and lp.shape == ent.shape == v.shape == (N, A, T)
        for x in (seq_out, lp, ent, v):
            assert torch.isfinite(x).all()
        torch.testing.assert_close(seq_out, out[:, :, s], atol=1e-5, rtol=0)
        torch.testing.assert_close(lp, step_lp[:, :, s], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, step_ent[:, :, s], atol=1e-5, rtol=0)
        torch.testing.assert_close(v, value[:, :, s], atol=1e-5, rtol=0)
        fast_out, fast_v = m.seq(obs[:, :, s], start, resets[:, :, s], active[:, :, s], idle_outputs=False)
        act = active[:, :, s]
        assert torch.isfinite(fast_out).all()
        torch.testing.assert_close(fast_out[act], seq_out[act], atol=1e-5, rtol=0)
        torch.testing.assert_close(fast_v[act], seq_v[act], atol=1e-5, rtol=0)
        for f in before._batch_dims:  # the sequence forward leaves start_state untouched
            assert torch.equal(getattr(before, f), getattr(start, f))


@pytest.mark.parametrize("kind", ["lstm", "transformer"])
def test_step_semantics(kind):
    m = make(kind)
    obs, resets, active = episode_data(2 * T)
    st = m.initial_state(N * A)
    replay(m, obs, resets, active, st)
    with torch.no_grad():
        before = st.clone()
        m.step(obs[:, :, 0], st, active=torch.zeros(N, A, dtype=torch.bool))  # inactive: nothing written
        v = m.value_step(obs[:, :, 1], st)  # a peek: nothing written either
        for f in before._batch_dims:
            assert torch.equal(getattr(before, f), getattr(st, f))
        out, v_step = m.step(obs[:, :, 1], st.clone())
        torch.testing.assert_close(v, v_step)
        # a reset makes the memory irrelevant: same output as from a fresh state
        out_reset, _ = m.step(obs[:, :, 1], st.clone(), reset=torch.ones(N, A, dtype=torch.bool))
        out_fresh, _ = m.step(obs[:, :, 1], m.initial_state(N * A))
        torch.testing.assert_close(out_reset, out_fresh, atol=1e-6, rtol=0)
        assert not torch.allclose(out_reset, out)
        action, logp, value, same = m.act_step(obs[:, :, 1], st, greedy=True)
        assert same is st and action.shape == (N, A) and logp.shape == value.shape == (N, A)
        torch.testing.assert_close(action, out.argmax(-1))
    # state helpers: select / cat along the slot axis
    rows = torch.tensor([4, 0])
    part = st.select(rows)
    assert part.batch_size == 2
    whole = type(st).cat([st.select(torch.arange(3)), st.select(torch.arange(3, N * A))])
    for f in st._batch_dims:
        assert torch.equal(getattr(whole, f), getattr(st, f))


@pytest.mark.parametrize("centralized", [False, True])
@pytest.mark.parametrize("kind", ["lstm", "transformer"])
def test_gradients_reach_every_parameter(kind, centralized):
    kw = {"state_dim": 7} if centralized else {}
    m = make(kind, SPACES["box"], **kw)
    assert m.memory_critic is not centralized
    obs, resets, active = episode_data(2 * T)
    _, _, snap = replay(m, obs, resets, active, m.initial_state(N * A), snapshot_at=T)
    actions = torch.randn(N, A, T, 2)
    lp, ent, v = m.evaluate_seq(obs[:, :, T:], actions, snap, resets[:, :, T:], active[:, :, T:])
    if centralized:
        assert v is None
        v = m.value(torch.randn(N, A, T, 7).mean(1))  # states [N, T, S] -> [N, T, A]
        assert v.shape == (N, T, A)
    (lp.sum() + ent.sum() + v.sum()).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", ["lstm", "transformer"])
def test_no_nan_in_degenerate_segments(kind):
    m = make(kind, SPACES["multi"])
    obs = torch.randn(N, A, T, D)
    actions = torch.zeros(N, A, T, 3, dtype=torch.long)
    start = m.initial_state(N * A)
    cases = [
        (torch.zeros(N, A, T, dtype=torch.bool), torch.zeros(N, A, T, dtype=torch.bool)),  # all inactive
        (torch.ones(N, A, T, dtype=torch.bool), torch.ones(N, A, T, dtype=torch.bool)),  # resets every step
        (torch.ones(N, A, T, dtype=torch.bool), torch.zeros(N, A, T, dtype=torch.bool)),  # both
    ]
    for resets, active in cases:
        lp, ent, v = m.evaluate_seq(obs, actions, start, resets, active)
        (lp.sum() + ent.sum() + v.sum()).backward()
        assert all(torch.isfinite(x).all() for x in (lp, ent, v))
        assert all(torch.isfinite(p.grad).all() for p in m.parameters())
        out, value, _ = replay(m, obs, resets, active, m.initial_state(N * A))
        torch.testing.assert_close(m.head.log_prob(out, actions), lp.detach(), atol=1e-5, rtol=0)


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_kv_cache_step_is_vectorised():
    """The same torch calls for 2 or 40 slots (no Python loop over the batch), none reading a value
    back to the host (.item(), bool(), int(), tolist())."""
    m = make("transformer")
    counts = []
    for envs in (1, 20):
        st = m.initial_state(envs * A)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _ in range(5):  # fill past the horizon
                m.act_step(torch.randn(envs, A, D), st, generator=g)
            with _Calls() as calls:
                m.act_step(torch.randn(envs, A, D), st, torch.rand(envs, A) < 0.5, torch.rand(envs, A) < 0.5, g)
        counts.append(calls.names)
        assert isinstance(st, KVCache) and not isinstance(st, LSTMState)
    assert counts[0] == counts[1]
    host = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"}
    assert not host & set(counts[0]), host & set(counts[0])


def seq_call_names(m, lengths=(16, 128)) -> dict[int, list[str]]:
    """The torch calls of one sequence forward + backward per segment length."""
    names = {}
    for steps in lengths:
        g = torch.Generator().manual_seed(0)
        obs = torch.randn(N, A, steps, D, generator=g)
        resets, active = torch.rand(N, A, steps, generator=g) < 0.2, torch.rand(N, A, steps, generator=g) < 0.7
        with _Calls() as calls:
            out, value = m.seq(obs, m.initial_state(N * A), resets, active)
            (out.sum() + value.sum()).backward()
        names[steps] = calls.names
    return names


@pytest.mark.parametrize("kind", ["lstm", "transformer"])
def test_sequence_forward_is_batched_over_time(kind):
    """Training forwards make no Python loop per step: 8x longer segments add only the log2(T)
    rounds of the LSTM's c scan, one LSTM kernel call per segment, no host reads."""
    names = seq_call_names(make(kind))
    assert len(names[128]) - len(names[16]) <= 60, (len(names[16]), len(names[128]))
    host = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"}
    assert not host & set(names[128]), host & set(names[128])
    if kind == "lstm":
        assert names[16].count("lstm") == names[128].count("lstm") == 1
