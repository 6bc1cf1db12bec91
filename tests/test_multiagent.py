"""Multi-agent training mechanics: masks, parameter sharing, centralised critic, mixed teams."""

import copy
import json

import pytest
import torch

import phalanx
from phalanx.config import resolve
from phalanx.envs import Box, Discrete, EnvSpec, StepRecord, VecEnv, register
from phalanx.envs.base import generator_state, set_generator_state
from phalanx.trainer import Trainer


class TinyTeamEnv(VecEnv):
    """3 slots (roles 0, 0, 1); slot 2 leaves after 5 steps (terminated, then inactive); episodes
    last 10 steps (truncated). Reward: 1 when an agent's action equals argmax of its first 3 obs."""

    name = "tiny_team"
    num_agents = 3
    observation_space = Box.uniform(-1, 1, (4,))
    action_space = Discrete(3)
    state_space = Box.uniform(-1, 1, (5,))
    role_names = ("scout", "medic")
    scripted_names = ("zero",)

    def __init__(self, num_envs=1, device="cpu", seed=0, leave_at=5):
        self.num_envs, self.device = num_envs, torch.device(device)
        self.roles = torch.tensor([0, 0, 1], device=self.device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed or 0)
        self.leave_at = leave_at
        self.t = torch.zeros(num_envs, dtype=torch.long, device=self.device)

    def _obs(self):
        self.o = torch.rand(self.num_envs, 3, 4, generator=self.gen, device=self.device) * 2 - 1
        self.s = torch.rand(self.num_envs, 5, generator=self.gen, device=self.device)
        return self.o

    def _active(self):
        a = torch.ones(self.num_envs, 3, dtype=torch.bool, device=self.device)
        a[:, 2] = self.t < self.leave_at
        return a

    def reset(self, seed=None):
        if seed is not None:
            self.gen.manual_seed(seed)
        self.t.zero_()
        obs = self._obs()
        f = torch.zeros(self.num_envs, 3, dtype=torch.bool, device=self.device)
        return StepRecord(obs, torch.zeros(self.num_envs, 3, device=self.device), f, f, self._active(), f, obs, self.s, self.s)

    def step(self, actions):
        active = self._active()
        reward = (actions == self.o[..., :3].argmax(-1)).float() * active
        self.t += 1
        trunc = (self.t >= 10).unsqueeze(1).expand(-1, 3).clone()
        term = torch.zeros_like(trunc)
        term[:, 2] = self.t == self.leave_at
        final_obs, final_state = self.o.clone(), self.s.clone()
        self.t = torch.where(self.t >= 10, 0, self.t)
        obs = self._obs()
        info = {"steps": (self.t == 0).float() * 10}
        return StepRecord(obs, reward, term, trunc, self._active(), torch.zeros_like(trunc), final_obs, self.s, final_state, info)

    def scripted_actions(self, name, record, generator):
        return torch.zeros(self.num_envs, 3, dtype=torch.long, device=self.device)

    def state_dict(self):
        return {"t": self.t.clone(), "o": self.o.clone(), "s": self.s.clone(), "rng": generator_state(self.gen)}

    def load_state_dict(self, st):
        self.t, self.o, self.s = st["t"].clone(), st["o"].clone(), st["s"].clone()
        set_generator_state(self.gen, st["rng"])


register(EnvSpec("tiny_team", TinyTeamEnv, "test env: 3 slots, one leaves mid-episode"))
# On the CPU: the tests below write host tensors into the rollout buffers.
BASE = dict(env="tiny_team", num_envs=4, num_steps=12, num_epochs=2, num_minibatches=2, progress=False, tensorboard=False,
            device="cpu")


def make_trainer(tmp_path, **kw):
    return Trainer(resolve({**BASE, **kw}), run_dir=tmp_path / "r")


def test_inactive_steps_change_nothing_in_the_update(tmp_path):
    tr = make_trainer(tmp_path, norm_value=True, critic="mappo")
    tr.collect()
    inactive = ~tr.run.buffer["active"]
    assert inactive.any() and tr.run.buffer["active"].any()
    model0, opt0, norms0, gen0 = (copy.deepcopy(tr.run.model.state_dict()), copy.deepcopy(tr.run.optimizer.state_dict()),
                                  copy.deepcopy(tr.run.norms.state_dict()), tr.run.gen.get_state())
    buf0 = {k: v.clone() for k, v in tr.run.buffer.items()}
    tr.update()
    after_a = {k: v.clone() for k, v in tr.run.model.state_dict().items()}
    # Rewind, scramble everything recorded at inactive steps, update again.
    tr.run.model.load_state_dict(model0)
    tr.run.optimizer.load_state_dict(opt0)
    tr.run.norms.load_state_dict(norms0)
    tr.run.gen.set_state(gen0)
    for k, v in buf0.items():
        tr.run.buffer[k].copy_(v)
    g = torch.Generator().manual_seed(9)
    m = inactive
    tr.run.buffer["obs"][m] = torch.randn(int(m.sum()), 4, generator=g) * 100
    tr.run.buffer["rewards"][m] = torch.randn(int(m.sum()), generator=g) * 1e6
    tr.run.buffer["actions"][m] = torch.randint(0, 3, (int(m.sum()),), generator=g)
    tr.run.buffer["logprobs"][m] = torch.randn(int(m.sum()), generator=g) * 50
    tr.run.buffer["values"][m] = torch.randn(int(m.sum()), generator=g) * 1e3
    tr.update()
    for k, v in tr.run.model.state_dict().items():
        assert torch.allclose(v, after_a[k], atol=1e-6, rtol=0), k
    tr.close()


def test_scrambling_active_steps_does_change_the_update(tmp_path):
    tr = make_trainer(tmp_path)
    tr.collect()
    model0, opt0, gen0 = copy.deepcopy(tr.run.model.state_dict()), copy.deepcopy(tr.run.optimizer.state_dict()), tr.run.gen.get_state()
    buf0 = {k: v.clone() for k, v in tr.run.buffer.items()}
    tr.update()
    after_a = {k: v.clone() for k, v in tr.run.model.state_dict().items()}
    tr.run.model.load_state_dict(model0)
    tr.run.optimizer.load_state_dict(opt0)
    tr.run.gen.set_state(gen0)
    for k, v in buf0.items():
        tr.run.buffer[k].copy_(v)
    tr.run.buffer["rewards"][tr.run.buffer["active"]] += 5.0 * torch.randn(int(tr.run.buffer["active"].sum()))
    tr.update()
    assert any(not torch.allclose(v, after_a[k]) for k, v in tr.run.model.state_dict().items())
    tr.close()


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_counts_for_sharing_modes(tmp_path):
    shared = make_trainer(tmp_path / "a").run.model
    with_id = make_trainer(tmp_path / "b", param_sharing="shared_id").run.model
    per_role = make_trainer(tmp_path / "c", param_sharing="per_role").run.model
    # shared_id: the first layer of actor and critic reads 3 more inputs (the one-hot slot id).
    assert n_params(with_id) - n_params(shared) == 2 * 3 * 64
    # per_role: one full copy per role (2 roles).
    assert n_params(per_role) == 2 * n_params(shared)


def test_per_role_gradients_stay_within_the_role(tmp_path):
    model = make_trainer(tmp_path, param_sharing="per_role").run.model
    obs = torch.randn(6, 3, 4)
    actions = torch.randint(0, 3, (6, 3))
    logp, _ = model.evaluate(obs, actions)
    logp[:, 2].sum().backward()  # slot 2 alone: role 1
    first = model.actor[0]
    assert first.weight.grad[1].abs().sum() > 0
    assert first.weight.grad[0].abs().sum() == 0
    model.zero_grad()
    logp, _ = model.evaluate(obs, actions)
    logp[:, 0].sum().backward()  # slot 0: role 0
    assert first.weight.grad[0].abs().sum() > 0 and first.weight.grad[1].abs().sum() == 0


def test_centralized_critic_reads_the_global_state(tmp_path):
    mappo = make_trainer(tmp_path / "m", critic="mappo").run.model
    ippo = make_trainer(tmp_path / "i").run.model
    s1, s2 = torch.rand(2, 5), torch.rand(2, 5)
    v1, v2 = mappo.value(s1), mappo.value(s2)
    assert v1.shape == (2, 3) and not torch.allclose(v1, v2)
    assert not torch.allclose(v1[:, 0], v1[:, 1]), "the agent id makes values per agent"
    obs = torch.randn(2, 3, 4)
    assert ippo.value(obs).shape == (2, 3)
    assert resolve({**BASE, "critic": "mappo"}).norm_value is True
    assert resolve({**BASE, "critic": "mappo", "norm_value": False}).norm_value is False


def test_teammates_are_not_trained_or_counted(tmp_path):
    tr = make_trainer(tmp_path, teammates="zero")
    assert tr.run.rollout.learner.tolist() == [True, True, False]
    tr.collect()
    assert not tr.run.buffer["active"][..., 2].any()
    assert (tr.run.buffer["actions"][..., 2] == 0).all()
    tr.close()
    with pytest.raises(phalanx.errors.ConfigError, match="unknown policy 'hero'; allowed: zero"):
        make_trainer(tmp_path / "x", teammates="hero")


def test_multiagent_run_logs_team_metrics(tmp_path):
    res = phalanx.train(**{**BASE, "total_steps": 4 * 12 * 3}, run_dir=tmp_path / "r", critic="mappo", param_sharing="per_role")
    m = res.metrics
    assert m["team_return"] > 0 and m["env_steps"] == pytest.approx(10.0)
    # Agent episodes: slots 0,1 end at step 10, slot 2 at step 5; each slot-episode counted once.
    assert m["episode_length"] == pytest.approx((10 + 10 + 5) / 3, rel=0.2)
    pol = phalanx.load(res.run_dir)
    assert pol.act(torch.randn(7, 3, 4)).shape == (7, 3)


def test_frozen_checkpoint_teammate_plays_but_does_not_learn(tmp_path):
    first = phalanx.train(**{**BASE, "total_steps": 4 * 12 * 2}, run_dir=tmp_path / "first")
    tr = make_trainer(tmp_path / "second", teammates=f"run:{first.run_dir}")
    frozen = tr.run.rollout.teammates.plan.players[0]
    before = {k: v.clone() for k, v in frozen.model.state_dict().items()}
    tr.collect()
    tr.update()
    assert not tr.run.buffer["active"][..., 2].any() and tr.run.buffer["active"][..., :2].any()
    for k, v in frozen.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    tr.close()


def test_a_frozen_teammate_with_memory_forgets_it_where_its_episode_starts(tmp_path):
    """A `run:` teammate with memory is reset at its slots' episode starts, as the learner is: after some steps
    and a reset it holds what a fresh copy holds after that one step (it once carried memory across episodes)."""
    from phalanx.slots import Teammates, random_actions

    first = phalanx.train(**{**BASE, "model": "lstm", "total_steps": 4 * 12 * 2}, run_dir=tmp_path / "first")
    env = phalanx.envs.make(BASE["env"], num_envs=4, seed=0)
    slots = ["", "", f"run:{first.run_dir}"]
    played, fresh = Teammates(slots, env, torch.device("cpu")), Teammates(slots, env, torch.device("cpu"))
    rec = env.reset(seed=0)
    actions = random_actions(env, torch.Generator().manual_seed(0))
    no_reset, reset = torch.zeros(env.num_envs, env.num_agents, dtype=torch.bool), torch.ones(env.num_envs, env.num_agents, dtype=torch.bool)
    for i in range(3):
        played.fill(actions, rec, torch.Generator().manual_seed(i), no_reset)
    played.fill(actions, rec, torch.Generator().manual_seed(9), reset)
    fresh.fill(actions, rec, torch.Generator().manual_seed(9), no_reset)
    memory, expected = played.plan.players[0].memory, fresh.plan.players[0].memory
    assert torch.equal(memory.h, expected.h) and torch.equal(memory.c, expected.c)


@pytest.mark.parametrize("model", ["lstm", "transformer"])
def test_memory_policy_training_forward_reproduces_the_rollout(tmp_path, model):
    """The sequence forward over the stored segments gives the rollout's own log-probs (ratio 1)."""
    tr = Trainer(resolve({"env": "trial_nav", "num_envs": 48, "num_steps": 20, "num_minibatches": 2, "model": model,
                          "tf_horizon": 8, "progress": False, "tensorboard": False}), run_dir=tmp_path / "r")
    tr.collect()
    tr.collect()  # the second rollout starts mid-episode, from stored memory, and crosses episode starts
    b = tr.run.buffer
    assert b["resets"].any() and (~b["env_active"]).any(), "segments must contain episode starts and parked slots"
    # Memory resets exactly after terminated/truncated steps, never after a trial end alone.
    ended = b["terminated"] | b["truncated"]
    assert torch.equal(b["resets"][1:], ended[:-1])
    assert (b["trial_end"] & ~ended).any(), "trial ends inside an episode must occur (and keep memory)"
    seg = lambda x: x.permute(1, 2, 0, *range(3, x.dim()))  # noqa: E731
    with torch.no_grad():
        logp, _, value = tr.run.model.evaluate_seq(seg(b["obs"]), seg(b["actions"]), tr.run.buffer.segment_start, seg(b["resets"]), seg(b["env_active"]))
    act = seg(b["env_active"])
    assert torch.allclose(logp[act], seg(b["logprobs"])[act], atol=1e-5)
    assert torch.allclose(value[act], seg(b["values"])[act], atol=1e-4)
    tr.update()
    tr.close()


@pytest.mark.parametrize("model", ["lstm", "transformer"])
def test_memory_policy_resume_is_bit_identical(tmp_path, model):
    from safetensors.torch import load_file

    from phalanx import checkpoint as ckpt

    cfg = {"env": "trial_nav", "num_envs": 4, "num_steps": 16, "num_minibatches": 2, "num_epochs": 2, "model": model,
           "tf_horizon": 8, "lstm_hidden": 32, "total_steps": 4 * 16 * 4, "checkpoint_every": 64, "progress": False,
           "tensorboard": False}
    phalanx.train(run_dir=tmp_path / "full", **cfg)
    phalanx.train(run_dir=tmp_path / "part", max_updates=2, **cfg)
    phalanx.train(resume=tmp_path / "part")
    a = load_file(str(ckpt.latest_checkpoint(tmp_path / "full") / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(tmp_path / "part") / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_transformer_checkpoint_with_the_cache_layers_first_resumes_bit_identically(tmp_path):
    """The KV cache now keeps its slots first (issue 63: a deployed graph transposed it in and out of every call);
    a checkpoint written before (cache [layers, B, ...], no "memory_layout" in its meta) still resumes exactly."""
    import json

    from safetensors.torch import load_file, save_file

    from phalanx import checkpoint as ckpt

    cfg = {"env": "trial_nav", "num_envs": 4, "num_steps": 16, "num_minibatches": 2, "num_epochs": 2,
           "model": "transformer", "tf_horizon": 8, "tf_layers": 3, "total_steps": 4 * 16 * 4, "checkpoint_every": 64,
           "progress": False, "tensorboard": False}
    phalanx.train(run_dir=tmp_path / "full", **cfg)
    phalanx.train(run_dir=tmp_path / "part", max_updates=2, **cfg)
    saved = ckpt.latest_checkpoint(tmp_path / "part")
    state = load_file(str(saved / ckpt.STATE_FILE))
    assert state["memory.k"].shape[:2] == (4 * 2, 3)  # 4 envs x 2 agents, then the layers
    for name in ("memory.k", "memory.v"):
        state[name] = state[name].transpose(0, 1).contiguous()
    save_file(state, str(saved / ckpt.STATE_FILE))
    meta = json.loads((saved / "meta.json").read_text())
    del meta["memory_layout"]
    meta["digests"][ckpt.STATE_FILE] = ckpt._digest(saved / ckpt.STATE_FILE)
    (saved / "meta.json").write_text(json.dumps(meta))
    phalanx.train(resume=tmp_path / "part")
    a = load_file(str(ckpt.latest_checkpoint(tmp_path / "full") / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(tmp_path / "part") / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_per_world_critic_values_every_agent_in_one_pass(tmp_path):
    """`mappo_values: per_world`: the state alone in, one output per agent (no id appended, one pass per world);
    its values fit the returns as the per-agent critic's do (explained variance after a few updates)."""
    world = make_trainer(tmp_path / "w", critic="mappo")  # the default where the model allows
    per_agent = make_trainer(tmp_path / "a", critic="mappo", mappo_values="per_agent")
    try:
        assert world.run.model.critic[0].in_features == 5 and per_agent.run.model.critic[0].in_features == 5 + 3
        s = torch.rand(7, 5)
        v = world.run.model.value(s)
        assert v.shape == (7, 3) and not torch.allclose(v[:, 0], v[:, 1])
        fitted = {}
        for name, tr in (("world", world), ("per_agent", per_agent)):
            for _ in range(30):
                tr.collect()
                metrics = tr.update()
            fitted[name] = float(metrics["explained_variance"])
        assert fitted["world"] > 0.5 and fitted["world"] > fitted["per_agent"] - 0.2, fitted
    finally:
        world.close()
        per_agent.close()
    assert world.run.cfg.mappo_values == "per_world"
    for bad, needle in ((dict(), "needs critic mappo; got critic ippo"),
                        (dict(critic="mappo", param_sharing="per_role"), "param_sharing per_role"),
                        (dict(critic="mappo", model="lstm"), "got model lstm")):
        with pytest.raises(phalanx.errors.ConfigError, match=needle):
            make_trainer(tmp_path / "x", mappo_values="per_world", **bad)


def test_the_critic_default_is_per_world_where_the_model_allows_and_old_runs_keep_theirs(tmp_path):
    defaults = {(model, sharing): resolve(dict(BASE, critic="mappo", model=model, param_sharing=sharing)).mappo_values
                for model, sharing in (("mlp", "shared"), ("mlp", "per_role"), ("lstm", "shared"))}
    assert defaults == {("mlp", "shared"): "per_world", ("mlp", "per_role"): "per_agent", ("lstm", "shared"): "per_agent"}
    # A run written before the key existed trained a per-agent critic: loading or resuming it builds that one.
    phalanx.train(run_dir=tmp_path / "old", max_updates=1, **dict(BASE, critic="mappo", mappo_values="per_agent"))
    path = tmp_path / "old" / "config.json"
    saved = json.loads(path.read_text())
    del saved["mappo_values"]
    path.write_text(json.dumps(saved))
    policy = phalanx.load(tmp_path / "old")
    assert policy.config.mappo_values == "per_agent"
    phalanx.train(resume=tmp_path / "old", max_updates=1)


@pytest.mark.parametrize("over", [dict(critic="mappo"), dict(model="lstm"), dict(norm_adv=False, clip_vloss=False)])
def test_an_update_in_chunks_is_the_whole_update(tmp_path, over):
    """`update_chunks`: each minibatch's forward and backward in 3 pieces, normalised over the whole minibatch
    (its masked count and advantage statistics), gives the parameters and metrics of the one-piece update up to
    float summation order (tiny_team has inactive slots: the masked means)."""
    out = []
    for chunks in (1, 3):
        tr = make_trainer(tmp_path / str(chunks), update_chunks=chunks, seed=5, **over)
        try:
            tr.collect()
            assert not bool(tr.run.buffer["active"].all())
            metrics = tr.update()
            out.append(([p.detach().clone() for p in tr.run.model.parameters()], metrics))
        finally:
            tr.close()
    (whole, mw), (chunked, mc) = out
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, chunked))
    assert any(not torch.equal(a, b) for a, b in zip(whole, make_trainer(tmp_path / "fresh", seed=5, **over).run.model.parameters()))
    for k in ("loss", "policy_loss", "value_loss", "approx_kl", "clip_fraction", "grad_norm"):
        assert torch.allclose(mw[k], mc[k], atol=1e-6), k
