"""CNN policies: encoder shapes and normalisation, the feed-forward actor-critic, and the memory
variant's sequence forward == step forward replayed."""

import pytest
import torch

from phalanx.envs.spaces import Discrete
from phalanx.models.cnn import CNNActorCritic, CNNEncoder, CNNMemoryActorCritic, conv_min_size
from phalanx.models.memory import KVCache, LSTMState

IMG = (4, 72, 80)
SMALL = dict(channels=(8, 16, 16), out_dim=32)  # default kernels/strides, fewer channels: fast tests


def pixels(*shape, seed=0):
    return torch.randint(0, 4, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def assert_grads(model):
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_encoder_conv_arithmetic():
    enc = CNNEncoder(IMG)
    assert enc.pad == (0, 0, 0, 0)
    assert enc.conv_out_dim == 64 * 5 * 6  # 72x80 -> 17x19 -> 7x8 -> 5x6
    assert conv_min_size((8, 4, 3), (4, 2, 1)) == 36


def test_encoder_uint8_float_and_batch_dims():
    torch.manual_seed(0)
    enc = CNNEncoder(IMG, **SMALL)
    x = pixels(3, *IMG)
    out = enc(x)
    assert out.shape == (3, 32) and out.dtype == torch.float32
    assert torch.equal(out, enc(x.float()))
    nested = enc(x.reshape(3, 1, 1, *IMG))
    assert nested.shape == (3, 1, 1, 32)
    torch.testing.assert_close(nested.reshape(3, 32), out, rtol=0, atol=1e-6)
    assert out.abs().sum() > 0
    with pytest.raises(ValueError, match="expected images"):
        enc(pixels(3, 4, 72, 81))


def test_encoder_small_images_are_padded():
    enc = CNNEncoder((2, 16, 21), **SMALL)
    assert enc.pad == (7, 8, 10, 10) and enc.conv_out_dim == 16
    assert enc(pixels(5, 2, 16, 21)).shape == (5, 32)


@pytest.mark.parametrize("agents,agent_id,shared", [(1, False, True), (2, True, True), (2, False, False)])
def test_actor_critic_shapes_logprob_and_grads(agents, agent_id, shared):
    torch.manual_seed(0)
    model = CNNActorCritic(IMG, Discrete(7), hidden_sizes=(16,), num_agents=agents, agent_id=agent_id,
                           shared_encoder=shared, **SMALL)
    assert model.obs_is_image and not model.recurrent and not model.centralized
    obs = pixels(5, agents, *IMG)
    action, logp = model.act(obs, torch.Generator().manual_seed(1))
    assert action.shape == (5, agents) and logp.shape == (5, agents)
    assert ((action >= 0) & (action < 7)).all()
    greedy, _ = model.act(obs, greedy=True)
    assert greedy.shape == (5, agents)
    new_logp, ent = model.evaluate(obs, action)
    assert ent.shape == (5, agents)
    torch.testing.assert_close(new_logp, logp, rtol=0, atol=1e-6)
    value = model.value(obs)
    assert value.shape == (5, agents)
    # The fused forwards equal the separate ones.
    lp2, ent2, v2 = model.evaluate_value(obs, action)
    torch.testing.assert_close((lp2, ent2, v2), (new_logp, ent, value), rtol=0, atol=1e-6)
    a3, lp3, v3 = model.act_value(obs, torch.Generator().manual_seed(1))
    assert torch.equal(a3, action)
    torch.testing.assert_close((lp3, v3), (logp, value), rtol=0, atol=1e-6)
    # Batched over time as in a [T, N, A, ...] buffer.
    assert model.value(obs.reshape(5, 1, agents, *IMG)).shape == (5, 1, agents)
    # Every parameter learns from a loss over evaluate + value.
    target = torch.randn(5, agents)
    loss = -(new_logp * torch.randn(5, agents)).mean() - 0.01 * ent.mean() + (value - target).pow(2).mean()
    loss.backward()
    assert_grads(model)


def test_actor_critic_rejects_centralized_critic():
    with pytest.raises(ValueError, match="centralized"):
        CNNActorCritic(IMG, Discrete(7), state_dim=10)
    with pytest.raises(ValueError, match="centralized"):
        CNNMemoryActorCritic(IMG, Discrete(7), state_dim=10)


N, A, T, SMALL_IMG = 2, 1, 6, (4, 16, 16)
CORES = {"lstm": dict(hidden=16), "transformer": dict(width=16, layers=2, heads=2, horizon=2)}


def make_memory(core, **kw):
    torch.manual_seed(0)
    return CNNMemoryActorCritic(SMALL_IMG, Discrete(7), core=core, num_agents=A, **SMALL, **CORES[core], **kw)


@pytest.mark.parametrize("core", sorted(CORES))
def test_memory_seq_equals_step_replay(core):
    model = make_memory(core)
    assert model.recurrent and model.obs_is_image and model.memory_critic and not model.centralized
    assert model.num_agents == A and model.head is model.core.head
    state = model.initial_state(N * A)
    assert isinstance(state, LSTMState if core == "lstm" else KVCache)
    warm = pixels(N, A, 3, *SMALL_IMG, seed=1)
    obs = pixels(N, A, T, *SMALL_IMG, seed=2)
    resets = torch.zeros(N, A, T, dtype=torch.bool)
    resets[0, 0, 3] = resets[1, 0, 0] = True  # an episode start mid-segment and at its start
    active = torch.ones(N, A, T, dtype=torch.bool)
    active[1, 0, 2] = active[0, 0, 4] = False
    with torch.no_grad():
        for t in range(warm.shape[2]):  # a non-trivial start state
            model.step(warm[:, :, t], state)
        start = state.clone()
        outs, values = [], []
        for t in range(T):
            out, v = model.step(obs[:, :, t], state, resets[:, :, t], active[:, :, t])
            outs.append(out)
            values.append(v)
        peek = model.value_step(obs[:, :, 0], state)
        assert peek.shape == (N, A)
        out_seq, v_seq = model.seq(obs, start, resets, active)
    torch.testing.assert_close(out_seq, torch.stack(outs, 2), rtol=0, atol=1e-5)
    torch.testing.assert_close(v_seq, torch.stack(values, 2), rtol=0, atol=1e-5)
    # act_step samples with the same memory semantics.
    state2 = start.clone()
    with torch.no_grad():
        action, logp, v, _ = model.act_step(obs[:, :, 0], state2, resets[:, :, 0], active[:, :, 0],
                                            torch.Generator().manual_seed(3))
    assert action.shape == logp.shape == v.shape == (N, A)
    torch.testing.assert_close(v, values[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("core", sorted(CORES))
def test_memory_evaluate_seq_trains_encoder(core):
    model = make_memory(core)
    start = model.initial_state(N * A)
    obs = pixels(N, A, T, *SMALL_IMG, seed=4)
    resets = torch.zeros(N, A, T, dtype=torch.bool)
    resets[0, 0, 2] = True
    actions = torch.randint(0, 7, (N, A, T))
    logp, ent, value = model.evaluate_seq(obs, actions, start, resets, None, idle_outputs=False)
    assert logp.shape == ent.shape == value.shape == (N, A, T)
    (-(logp * torch.randn(N, A, T)).mean() - 0.01 * ent.mean() + value.pow(2).mean()).backward()
    assert_grads(model.encoder)
    assert model.core.actor_out.weight.grad.abs().sum() > 0
    keys = model.state_dict().keys()
    assert any(k.startswith("encoder.") for k in keys) and not any(k.startswith("head.") for k in keys)


def test_memory_memoryless_critic_reads_images():
    model = make_memory("lstm", memory_critic=False, critic_hidden=(8,))
    assert not model.memory_critic
    assert model.value(pixels(3, A, *SMALL_IMG)).shape == (3, A)
    with pytest.raises(ValueError, match="core must be one of"):
        CNNMemoryActorCritic(SMALL_IMG, Discrete(7), core="gru")
