"""Role attention (A-MAPPO): pooled softmax, relay floor, masking, and the actor-critic built on it."""

import importlib

import pytest
import torch

from phalanx.config import resolve
from phalanx.envs.spaces import Box, Discrete, MultiDiscrete
from phalanx.models.mlp import MLPActorCritic
from phalanx.models.registry import obs_dim_of, state_dim_of
from phalanx.models.role_attention import RoleAttentionActorCritic, role_attention_weights

S, R, C = 0, 1, 2  # sensor, relay, cluster head (pooled with the sensors by default)
FLOOR = 0.05
train_mod = importlib.import_module("phalanx.trainer")
build_mod = importlib.import_module("phalanx.build")


def weights(scores, roles, mask=None, **kw):
    return role_attention_weights(scores, torch.as_tensor(roles), mask, **kw)


def check_distribution(w, present):
    """Rows with a present key sum to one, rows without are all zero; absent keys get exactly 0."""
    assert torch.isfinite(w).all()
    assert (w >= 0).all()
    assert (w[~present.expand_as(w)] == 0).all()
    has = present.expand_as(w).any(-1)
    sums = w.sum(-1)
    assert torch.allclose(sums[has], torch.ones_like(sums[has]), atol=1e-5)
    assert (sums[~has] == 0).all()


def relay_weights_ok(w, roles, present):
    relay = (torch.as_tensor(roles) == R) & present
    assert (w[relay.expand_as(w)] >= FLOOR - 1e-6).all()


def test_random_weights_are_distributions_with_the_floor():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 5, 9, generator=g) * 4
    roles = torch.randint(0, 3, (64, 9), generator=g)
    mask = torch.rand(64, 9, generator=g) < 0.6
    w = weights(scores, roles, mask)
    present = mask.unsqueeze(-2)
    check_distribution(w, present)
    relay_weights_ok(w, roles.unsqueeze(-2), present)
    # Shared key roles [K] with a per-pair mask [..., Q, K] work too.
    pair = torch.rand(64, 5, 9, generator=g) < 0.5
    w = weights(scores, roles[0], pair)
    check_distribution(w, pair)
    relay_weights_ok(w, roles[0], pair)


@pytest.mark.parametrize("roles", [[S, C, S, S], [R, R, R], [S, S, R, R, R, R, R, R, R, R, R, R, R, R, R, R, R, R, R, R]])
def test_edge_cases_single_pools_and_many_relays(roles):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, len(roles), generator=g) * 10
    mask = torch.ones(len(roles), dtype=torch.bool)
    w = weights(scores, roles, mask)
    check_distribution(w, mask)
    relay_weights_ok(w, roles, mask)


def test_no_present_key_gives_zero_weights_and_no_nan_gradient():
    scores = torch.randn(2, 4, requires_grad=True)
    w = weights(scores, [S, R, S, R], torch.zeros(4, dtype=torch.bool))
    assert (w == 0).all()
    w.sum().backward()
    assert torch.isfinite(scores.grad).all()


def test_floor_holds_when_scores_strongly_favour_sensors():
    # The pools do not compete, so what the floor has to fight is one relay dominating its pool.
    roles = torch.tensor([S, S, C, R, R, R])
    scores = torch.tensor([[30.0, 25.0, 20.0, -30.0, -40.0, -35.0]])
    w = weights(scores, roles)
    check_distribution(w, torch.ones(6, dtype=torch.bool))
    assert torch.allclose(w[0, 4:], torch.full((2,), FLOOR), atol=1e-6)
    # The raise is paid by every key in proportion to its excess over its own floor (0 for sensors,
    # FLOOR for relays): the sensors' ratios are unchanged and the dominant relay stays above the floor.
    raw = weights(scores, roles, floor=0.0)
    assert raw[0, 4:].max() < FLOOR  # the floor did bind
    excess = raw[0].clone()
    excess[3:] -= FLOOR
    excess[4:] = 0
    expected = torch.cat([torch.zeros(3), torch.full((3,), FLOOR)]) + (1 - 3 * FLOOR) * excess / excess.sum()
    assert torch.allclose(w[0], expected, atol=1e-6)
    assert w[0, 3] > FLOOR
    # Not binding: the floor changes nothing.
    mild = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -0.5]])
    assert torch.allclose(weights(mild, roles), weights(mild, roles, floor=0.0), atol=1e-7)


def test_floor_among_relays_only_and_infeasible_floor():
    # 20 relays alone, one dominant: the floor binds inside the lone pool (20 * 0.05 = 1 -> uniform).
    scores = torch.zeros(1, 20)
    scores[0, 0] = 50.0
    w = weights(scores, [R] * 20)
    assert torch.allclose(w, torch.full_like(w, 0.05), atol=1e-6)
    # 25 relays: 25 * 0.05 > 1, so the floor becomes 1/25 (documented) and weights stay a distribution.
    scores = torch.zeros(1, 25)
    scores[0, 0] = 50.0
    w = weights(scores, [R] * 25)
    assert torch.allclose(w, torch.full_like(w, 1 / 25), atol=1e-6)


def test_pool_masses():
    roles = torch.tensor([S, C, S, R, R])
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(8, 5, generator=g)
    scores[:, 3:] = 0.0  # two equal relays: 0.2 each, the floor does not bind
    w = weights(scores, roles)
    assert torch.allclose(w[:, :3].sum(-1), torch.full((8,), 0.6), atol=1e-6)
    assert torch.allclose(w[:, 3:].sum(-1), torch.full((8,), 0.4), atol=1e-6)
    # Within a pool it is a plain softmax.
    assert torch.allclose(w[:, :3] / 0.6, torch.softmax(scores[:, :3], -1), atol=1e-6)
    # A pool emptied by the mask hands its mass to the other: the lone pool gets 1.0.
    no_relays = torch.tensor([True, True, True, False, False])
    w = weights(scores, roles, no_relays)
    assert torch.allclose(w[:, :3].sum(-1), torch.ones(8), atol=1e-6) and (w[:, 3:] == 0).all()
    no_sensors = ~no_relays
    w = weights(scores, roles, no_sensors)
    assert torch.allclose(w[:, 3:].sum(-1), torch.ones(8), atol=1e-6) and (w[:, :3] == 0).all()


def test_any_number_of_roles_and_pools():
    roles = torch.tensor([0, 1, 2, 3, 3, 4])
    scores = torch.zeros(2, 6)
    w = weights(scores, roles, pools=((0, 1), (2,), (3, 4)), masses=(0.5, 0.3, 0.2), floor_pool=1, floor=0.05)
    assert torch.allclose(w[:, :2].sum(-1), torch.full((2,), 0.5))
    assert torch.allclose(w[:, 2], torch.full((2,), 0.3))
    assert torch.allclose(w[:, 3:].sum(-1), torch.full((2,), 0.2))
    # Pool 2 absent: pools 0 and 1 share 0.5 : 0.3.
    mask = torch.tensor([True, True, True, False, False, False])
    w = weights(scores, roles, mask, pools=((0, 1), (2,), (3, 4)), masses=(0.5, 0.3, 0.2), floor_pool=1)
    assert torch.allclose(w[:, 2], torch.full((2,), 0.3 / 0.8))
    with pytest.raises(ValueError):
        weights(scores, roles, pools=((0, 1), (1,)), masses=(0.5, 0.5))
    with pytest.raises(ValueError):
        weights(scores, roles, pools=((0,), (1,)), masses=(1.0,))


def test_temperature_flattens_within_a_pool():
    roles = torch.tensor([S, S, S, R, R, R])
    scores = torch.tensor([[3.0, 1.0, -2.0, 2.0, 0.0, -1.0]])

    def pool_entropy(w, sl):
        p = w[0, sl] / w[0, sl].sum()
        return -(p * p.log()).sum()

    ws = [weights(scores, roles, temperature=t) for t in (0.5, 1.0, 4.0)]
    for sl in (slice(0, 3), slice(3, 6)):
        ent = [pool_entropy(w, sl) for w in ws]
        assert ent[0] < ent[1] < ent[2]
    # Without the floor (which binds at low temperature) the pool masses do not depend on it.
    for t in (0.5, 1.0, 4.0):
        assert torch.allclose(weights(scores, roles, temperature=t, floor=0.0)[0, :3].sum(), torch.tensor(0.6), atol=1e-6)


ROLES = torch.tensor([S, S, C, R])


def model(space=None, **kw):
    torch.manual_seed(0)
    return RoleAttentionActorCritic(16, space or Box.uniform(-1, 1, (4,)), roles=ROLES, num_roles=3, width=32,
                                    hidden_sizes=(32, 32), **kw)


def test_no_self_attention_and_absent_neighbours_get_zero():
    m = model(heads=2)
    obs = torch.randn(5, 4, 16)
    present = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1], [0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    att = m.attention(obs, present)  # [5, A, A]
    assert att.shape == (5, 4, 4)
    assert (att.diagonal(dim1=-2, dim2=-1) == 0).all()
    absent_cols = (~present).unsqueeze(-2).expand_as(att)
    assert (att[absent_cols] == 0).all()
    pair = present.unsqueeze(-2) & ~torch.eye(4, dtype=torch.bool)
    check_distribution(att, pair)
    assert m.last_weights.shape == (5, 2, 4, 4)
    # Every present relay neighbour keeps the floor in every head.
    relay_cols = (ROLES == R) & present.unsqueeze(-2) & ~torch.eye(4, dtype=torch.bool)
    assert (m.last_weights[relay_cols.unsqueeze(-3).expand_as(m.last_weights)] >= FLOOR - 1e-6).all()


def test_lonely_agent_gets_zero_context_and_garbage_in_absent_slots_stays_out():
    m = model(heads=2)
    obs = torch.randn(2, 4, 16)
    present = torch.tensor([[True, False, False, False], [True, True, True, True]])
    obs[0, 1:] = float("nan")  # dead agents' slots may hold anything
    _, ctx = m.actor_attn(obs, present)
    assert (ctx[0, 0] == 0).all()
    actions = torch.randn(2, 4, 4)
    logp, ent = m.evaluate(obs, actions, present)
    v = m.value(obs, present)
    assert torch.isfinite(logp[0, 0]) and torch.isfinite(v[0, 0]) and torch.isfinite(logp[1]).all()
    # An absent neighbour's observation does not change anyone else's output.
    obs2 = obs.clone()
    obs2[1, 3] += 5.0
    p2 = present.clone()
    p2[1, 3] = False
    a = m.evaluate(obs, actions, p2)[0][1, :3]
    b = m.evaluate(obs2, actions, p2)[0][1, :3]
    assert torch.allclose(a, b)


@pytest.mark.parametrize("state_dim", [None, 10])
def test_gradients_reach_every_parameter(state_dim):
    m = model(heads=2, state_dim=state_dim)
    g = torch.Generator().manual_seed(3)
    obs = torch.randn(6, 4, 16, generator=g)
    present = torch.rand(6, 4, generator=g) < 0.8
    present[0] = False
    present[1] = torch.tensor([True, False, False, False])
    with torch.no_grad():  # as in the rollout: a Gaussian sample carrying grad would cancel log_std's gradient
        actions, _ = m.act(obs, g, present=present)
    logp, ent = m.evaluate(obs, actions, present)
    critic_in = torch.randn(6, state_dim, generator=g) if state_dim else obs
    v = m.value(critic_in, present)
    (logp.sum() + ent.sum() + (v ** 2).sum()).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert (m.critic_attn is None) == (state_dim is not None)


SPACES = [Box.uniform(-1, 1, (4,)), Discrete(5), MultiDiscrete((3, 2, 4), gates=((2, 1, 1),))]


@pytest.mark.parametrize("space", SPACES, ids=["box", "discrete", "multi"])
@pytest.mark.parametrize("state_dim", [None, 10])
def test_shapes_match_mlp_actor_critic(space, state_dim):
    ours = model(space, state_dim=state_dim)
    ref = MLPActorCritic(16, space, (32, 32), num_agents=4, state_dim=state_dim)
    obs = torch.randn(7, 4, 16)
    critic_in = torch.randn(7, 10) if state_dim else obs
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    a1, lp1 = ours.act(obs, g1)
    a2, lp2 = ref.act(obs, g2)
    assert a1.shape == a2.shape and a1.dtype == a2.dtype and lp1.shape == lp2.shape == (7, 4)
    for x, y in zip(ours.evaluate(obs, a2), ref.evaluate(obs, a2)):
        assert x.shape == y.shape == (7, 4)
    assert ours.value(critic_in).shape == ref.value(critic_in).shape == (7, 4)
    greedy, _ = ours.act(obs, greedy=True)
    assert greedy.shape == a2.shape
    # No batch axis at all: obs [A, D].
    assert ours.act(obs[0])[0].shape == a2[0].shape


def test_agent_id_and_floor_validation():
    m = model(agent_id=True)
    assert m.act(torch.randn(3, 4, 16))[1].shape == (3, 4)
    with pytest.raises(AssertionError):
        RoleAttentionActorCritic(8, Discrete(2), roles=torch.tensor([0, 1, 1, 1]), num_roles=2, relay_floor=0.4)
    with pytest.raises(ValueError):
        RoleAttentionActorCritic(8, Discrete(2), roles=torch.tensor([0, 3]), num_roles=2)


def test_parameter_count_default():
    m = RoleAttentionActorCritic(64, Box.uniform(-1, 1, (4,)), roles=torch.tensor([S, S, C, R]), num_roles=3)
    # Per attention block: embed 64*64+64, query 64*64+64, key (64+3)*64+64, value 64*64+64.
    attn = 3 * (64 * 64 + 64) + (67 * 64 + 64)
    mlp_body = (131 * 64 + 64) + (64 * 64 + 64)
    expected = 2 * attn + (mlp_body + 64 * 4 + 4) + (mlp_body + 64 + 1) + 4
    assert sum(p.numel() for p in m.parameters()) == expected


def test_drop_in_for_the_trainer(tmp_path, monkeypatch):
    def build(cfg, env):
        return RoleAttentionActorCritic(obs_dim_of(env), env.action_space, roles=torch.tensor([S, R, S]),
                                        num_roles=2, width=16, hidden_sizes=(16,),
                                        state_dim=state_dim_of(env) if cfg.critic == "mappo" else None)

    monkeypatch.setattr(build_mod, "build_model", build)
    for critic in ("ippo", "mappo"):
        cfg = resolve(dict(env="bucket_brigade", env_options={"num_agents": 3}, num_envs=2, num_steps=6, num_epochs=1,
                           num_minibatches=1, progress=False, tensorboard=False, critic=critic))
        tr = train_mod.Trainer(cfg, run_dir=tmp_path / critic)
        before = [p.detach().clone() for p in tr.run.model.parameters()]
        tr.collect()
        metrics = tr.update()
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())
        assert any(not torch.equal(b, p) for b, p in zip(before, tr.run.model.parameters()))
        tr.close()
