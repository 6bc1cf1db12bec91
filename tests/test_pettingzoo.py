"""PettingZoo interop: `to_pettingzoo` (export) and the `pz:<module>:<factory>` import adapter."""

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo")
import json  # noqa: E402

from gymnasium import spaces as gs  # noqa: E402
from pettingzoo.test import parallel_api_test  # noqa: E402

import phalanx  # noqa: E402
from phalanx.cli import main  # noqa: E402
from phalanx.envs import Box, MultiDiscrete, StepRecord, VecEnv, check_env, make, to_pettingzoo  # noqa: E402
from phalanx.errors import ConfigError  # noqa: E402

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes `pz:pz_tiny:...` importable

TINY = "pz:pz_tiny:make_env"


class TinySquad(VecEnv):
    """A batched torch env with A=3 slots (scout, scout, medic) for the export tests.

    Each slot sees [cue0, cue1 / 2, t / max_steps, slot / 3] and earns (a0 == cue0) + 0.5 (a1 == cue1)
    with MultiDiscrete([2, 3]) actions. Slot 2 dies at step `die_step`: flagged terminated on that
    step, inactive (zero obs) afterwards. The others are truncated at `max_steps`; then the env
    auto-resets. Global state [N, 2]: (t / max_steps, number of living slots).
    """

    name = "tiny_squad"
    num_agents = 3
    observation_space = Box.uniform(0.0, 1.0, (4,))
    action_space = MultiDiscrete((2, 3))
    state_space = Box.uniform(0.0, 3.0, (2,))
    role_names = ("scout", "medic")

    def __init__(self, num_envs=1, device="cpu", seed=0, max_steps=6, die_step=3):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.max_steps, self.die_step = max_steps, die_step
        self.roles = torch.tensor([0, 0, 1], device=self.device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)
        self.slot = torch.arange(3, device=self.device)
        self._fresh()

    def _draw(self):
        n = self.num_envs
        self.cue0 = torch.randint(0, 2, (n, 3), generator=self.gen, device=self.device)
        self.cue1 = torch.randint(0, 3, (n, 3), generator=self.gen, device=self.device)

    def _fresh(self):
        n = self.num_envs
        self.t = torch.zeros(n, dtype=torch.long, device=self.device)
        self.alive = torch.ones(n, 3, dtype=torch.bool, device=self.device)
        self.ep_return = torch.zeros(n, device=self.device)
        self._draw()

    def _obs(self, alive):
        t = (self.t.float() / self.max_steps)[:, None].expand(-1, 3)
        o = torch.stack([self.cue0.float(), self.cue1.float() / 2, t, self.slot.float().expand_as(t) / 3], -1)
        return o * alive[..., None]

    def _state(self):
        return torch.stack([self.t.float() / self.max_steps, self.alive.sum(-1).float()], -1)

    def reset(self, seed=None):
        if seed is not None:
            self.gen.manual_seed(seed)
        self._fresh()
        o = self._obs(self.alive)
        f = torch.zeros(self.num_envs, 3, dtype=torch.bool, device=self.device)
        s = self._state()
        return StepRecord(obs=o, reward=torch.zeros(self.num_envs, 3), terminated=f, truncated=f.clone(),
                          active=self.alive.clone(), trial_end=f.clone(), final_obs=o, state=s, final_state=s)

    def step(self, actions):
        before = self.alive
        reward = ((actions[..., 0] == self.cue0).float() + 0.5 * (actions[..., 1] == self.cue1).float()) * before
        self.t = self.t + 1
        died = before & (self.slot == 2) & (self.t[:, None] == self.die_step)
        truncated = before & ~died & (self.t[:, None] >= self.max_steps)
        self.alive = before & ~died
        self.ep_return += reward.sum(-1)
        done = ~(self.alive & ~truncated).any(-1)
        self._draw()
        final_obs = self._obs(before)
        final_state = self._state()
        info = {
            "episode_return": torch.where(done, self.ep_return, 0.0),
            "episode_length": torch.where(done, self.t, 0).float(),
        }
        self.t = torch.where(done, 0, self.t)
        self.alive = self.alive | done[:, None]
        self.ep_return = torch.where(done, 0.0, self.ep_return)
        obs = self._obs(self.alive)
        final_obs = torch.where(done[:, None, None], final_obs, obs)
        final_obs = torch.where(died[..., None], self._obs(before), final_obs)  # dying slot: last obs
        return StepRecord(obs=obs, reward=reward, terminated=died, truncated=truncated, active=self.alive.clone(),
                          trial_end=torch.zeros_like(died), final_obs=final_obs, state=self._state(),
                          final_state=torch.where(done[:, None], final_state, self._state()), info=info)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _api_test(par_env, num_cycles=100):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel_api_test(par_env, num_cycles=num_cycles)
    msgs = [str(w.message) for w in caught if "pettingzoo" in (w.filename or "") or "agent" in str(w.message).lower()]
    assert not msgs, msgs


# --- export ---------------------------------------------------------------------------------------


def test_export_spaces_and_names():
    pz = to_pettingzoo(TinySquad(num_envs=1))
    assert pz.possible_agents == ["scout_0", "scout_1", "medic_0"]
    assert pz.action_space("medic_0") == gs.MultiDiscrete([2, 3])
    ospace = pz.observation_space("scout_0")
    assert isinstance(ospace, gs.Box) and ospace.shape == (4,) and ospace.dtype == np.float32
    assert pz.observation_space("scout_0") is pz.observation_space("scout_0")
    obs, infos = pz.reset(seed=3)
    assert pz.agents == pz.possible_agents and set(infos) == set(obs) == set(pz.agents)
    assert all(isinstance(o, np.ndarray) and o.dtype == np.float32 and ospace.contains(o) for o in obs.values())
    np.testing.assert_allclose(pz.state(), [0.0, 3.0])


@pytest.mark.parametrize("num_envs,index", [(1, 0), (3, 2)])
def test_export_passes_parallel_api_test(num_envs, index):
    _api_test(to_pettingzoo(TinySquad(num_envs=num_envs), index=index))


def test_export_bucket_brigade_passes_parallel_api_test():
    try:
        env = make("bucket_brigade", num_envs=1)
    except ConfigError as e:
        pytest.skip(f"bucket_brigade not available: {e}")
    _api_test(to_pettingzoo(env), num_cycles=300)


def test_export_matches_phalanx_env():
    ref, pz = TinySquad(num_envs=1, seed=7), to_pettingzoo(TinySquad(num_envs=1, seed=99))
    gen = torch.Generator().manual_seed(0)
    rec = ref.reset(seed=11)
    obs, _ = pz.reset(seed=11)
    episodes, steps = 0, 0
    while episodes < 3:
        assert set(pz.agents) <= set(obs)
        slots = [pz.possible_agents.index(a) for a in pz.agents]
        assert rec.active[0].nonzero().squeeze(1).tolist() == slots
        for a, s in zip(pz.agents, slots):
            np.testing.assert_array_equal(obs[a], rec.obs[0, s].numpy())
        np.testing.assert_array_equal(pz.state(), rec.state[0].numpy())
        acts = torch.stack([torch.randint(0, 2, (3,), generator=gen), torch.randint(0, 3, (3,), generator=gen)], -1)
        acts = acts * rec.active[0, :, None]  # the export sends 0 for slots without a live agent
        acting = list(pz.agents)
        obs, rew, term, trunc, infos = pz.step({a: acts[pz.possible_agents.index(a)].numpy() for a in acting})
        rec = ref.step(acts[None])
        steps += 1
        assert set(rew) == set(term) == set(trunc) == set(acting)
        for a in acting:
            s = pz.possible_agents.index(a)
            assert rew[a] == rec.reward[0, s].item() and isinstance(rew[a], float)
            assert term[a] == rec.terminated[0, s].item() and trunc[a] == rec.truncated[0, s].item()
            np.testing.assert_array_equal(obs[a], rec.final_obs[0, s].numpy())
        if steps % 6 == 3:
            assert term["medic_0"] and "medic_0" not in pz.agents and len(pz.agents) == 2
        if not pz.agents:
            assert steps % 6 == 0 and all(trunc[a] for a in acting)
            assert infos["scout_0"]["episode_length"] == 6.0
            assert infos["scout_0"]["episode_return"] == rec.info["episode_return"][0].item()
            episodes += 1
            with pytest.raises(RuntimeError, match="reset"):
                pz.step({})
            rec = ref.reset()
            obs, _ = pz.reset()


def test_export_requires_actions_of_live_agents():
    pz = to_pettingzoo(TinySquad())
    pz.reset(seed=0)
    with pytest.raises(KeyError, match="medic_0"):
        pz.step({"scout_0": np.array([0, 0]), "scout_1": np.array([1, 1])})
    with pytest.raises(ConfigError, match="index 1"):
        to_pettingzoo(TinySquad(num_envs=1), index=1)


# --- import ---------------------------------------------------------------------------------------


def test_import_spaces_and_roles():
    env = make(TINY, num_envs=2, seed=0)
    assert env.num_agents == 3 and env.agent_names == ["worker_0", "worker_1", "leader_0"]
    assert env.role_names == ("worker", "leader") and env.roles.tolist() == [0, 0, 1]
    assert env.observation_space.shape == (3,) and env.action_space.n == 2
    assert env.state_dict() == {}


def test_import_inactive_slots_and_autoreset():
    n = 2
    env = make(TINY, num_envs=n, seed=5, max_cycles=6)  # options reach the factory
    rec = env.reset()
    assert rec.obs.shape == (n, 3, 3) and rec.obs.dtype == torch.float32 and rec.active.all()
    gen = torch.Generator().manual_seed(1)
    for t in range(1, 13):
        prev = rec
        actions = torch.randint(0, 2, (n, 3), generator=gen)
        rec = env.step(actions)
        for name in ("obs", "final_obs"):
            assert getattr(rec, name).shape == (n, 3, 3)
        for name in ("reward", "terminated", "truncated", "active", "trial_end"):
            assert getattr(rec, name).shape == (n, 3)
        # reward 1 where the action matches the target bit the slot saw, 0 for inactive slots
        expect = (actions == prev.obs[..., 0].long()).float() * prev.active
        torch.testing.assert_close(rec.reward, expect)
        k = (t - 1) % 6 + 1  # step within the episode
        if k == 3:  # worker_1 leaves: flagged on its last active step, then inactive with zero obs
            assert rec.terminated[:, 1].all() and not rec.terminated[:, [0, 2]].any()
            assert not rec.active[:, 1].any() and rec.active[:, [0, 2]].all()
            assert (rec.obs[:, 1] == 0).all()
            torch.testing.assert_close(rec.final_obs[:, 1, 1:], torch.tensor([[0.5, 1 / 3]] * n))
        elif k == 6:  # time limit: the rest are truncated, the copy auto-resets
            assert rec.truncated[:, [0, 2]].all() and not rec.truncated[:, 1].any()
            assert not rec.terminated.any() and rec.active.all()
            assert (rec.obs[..., 1] == 0).all()  # first observation of the next episode
            assert (rec.final_obs[:, [0, 2], 1] == 1.0).all() and (rec.final_obs[:, 1] == 0).all()
            assert rec.info["episode_length"].tolist() == [6.0] * n
        else:
            assert not (rec.terminated | rec.truncated).any()
            assert rec.active[:, 1].tolist() == [k < 3] * n
            torch.testing.assert_close(rec.final_obs, rec.obs)
            assert (rec.info["episode_length"] == 0).all()
        assert (rec.obs[~rec.active] == 0).all()


def test_import_seeds_copies_like_the_env_itself():
    import pz_tiny

    env = make(TINY, num_envs=3, seed=10)
    rec = env.reset()
    for i in range(3):
        obs, _ = pz_tiny.make_env().reset(seed=10 + i)
        np.testing.assert_array_equal(rec.obs[i].numpy(), np.stack([obs[a] for a in env.agent_names]))
    again = env.reset(seed=10)
    torch.testing.assert_close(again.obs, rec.obs)


def test_import_errors_are_one_line_config_errors():
    cases = {
        "pz:no_such_module_xyz:make_env": "cannot import module 'no_such_module_xyz'",
        "pz:pz_tiny:nope": "has no 'nope'",
        "pz:pz_tiny": "pz:<module>:<factory>",
        "pz:pz_tiny:make_box_leader": "action spaces may differ only in the size of a Discrete space; worker_0 has Discrete(2) "
                                      "but leader_0 has Box(-1.0, 1.0, (1,), float32)",
    }
    for name, msg in cases.items():
        with pytest.raises(ConfigError) as e:
            make(name)
        assert msg in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    with pytest.raises(ConfigError, match="rejected options"):
        make(TINY, bogus=1)


def test_import_then_export_round_trip_passes_api_test():
    _api_test(to_pettingzoo(make(TINY, num_envs=1, seed=0)))


def test_import_trains(tmp_path):
    total = 4 * 32 * 2
    result = phalanx.train(env=TINY, total_steps=total, num_envs=4, num_steps=32, progress=False,
                           tensorboard=False, run_dir=tmp_path / "r")
    assert result.metrics["step"] == total


def test_phalanx_imports_without_pettingzoo():
    code = (
        "import sys; sys.modules['pettingzoo'] = None\n"
        "import phalanx\n"
        "from phalanx.errors import ConfigError\n"
        "phalanx.make('cartpole')\n"
        "try:\n"
        "    phalanx.make('pz:pz_tiny:make_env')\n"
        "except ConfigError as e:\n"
        "    assert 'pip install pettingzoo' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=TESTS)


MPE = "pz:mpe2.{}:parallel_env"


def test_mixed_observation_spaces_are_padded_per_agent():
    """simple_adversary: the adversary sees 8 features, the agents 10; each slot holds its own agent's
    observation at fixed positions, zero-padded, and the global state comes from `state()`."""
    pytest.importorskip("mpe2")
    from mpe2 import simple_adversary_v3

    env = make(MPE.format("simple_adversary_v3"), num_envs=2, seed=3, max_cycles=25)
    assert env.observation_space.shape == (10,) and env.role_names == ("adversary", "agent")
    assert env.roles.tolist() == [0, 1, 1] and env.state_space.shape == (28,)
    rec = env.reset(seed=3)
    ref = simple_adversary_v3.parallel_env(max_cycles=25)
    obs, _ = ref.reset(seed=3)
    np.testing.assert_allclose(rec.obs[0, 0, :8].numpy(), obs["adversary_0"])
    assert (rec.obs[0, 0, 8:] == 0).all()
    np.testing.assert_allclose(rec.obs[0, 1].numpy(), obs["agent_0"])
    np.testing.assert_allclose(rec.state[0].numpy(), ref.state())
    check_env(env, steps=30)


@pytest.mark.parametrize("env_id, flags", [
    ("simple_adversary_v3", ["--param-sharing", "per_role"]),
    ("simple_tag_v3", ["--param-sharing", "per_role"]),
    ("simple_spread_v3", ["--critic", "mappo"]),
])
def test_mpe_envs_train_from_the_command_line(tmp_path, env_id, flags):
    pytest.importorskip("mpe2")
    run = tmp_path / env_id
    assert main(["train", "--env", MPE.format(env_id), "--max-cycles", "25", *flags, "--total-steps", "1024", "--num-envs", "4",
                 "--num-steps", "32", "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["env_options"] == {"max_cycles": 25}


def test_agents_with_different_numbers_of_actions_are_masked(tmp_path):
    """worker_* have 2 actions, leader_0 has 3: one Discrete(3) whose third action the workers' slots
    never take (the env refuses it), trained per role from the command line."""
    env = make("pz:pz_tiny:make_mixed", num_envs=2, seed=0)
    assert env.action_space.describe() == "Discrete(3, per slot [2, 2, 3])"
    check_env(env, steps=20)
    from phalanx.envs import ActionError

    env.reset(seed=0)
    with pytest.raises(ActionError, match=r"actions\[:, 0\] must lie in \[0, 2\)"):
        env.step(torch.tensor([[2, 0, 0], [0, 0, 0]]))
    run = tmp_path / "mixed"
    assert main(["train", "--env", "pz:pz_tiny:make_mixed", "--param-sharing", "per_role", "--total-steps", "512", "--num-envs", "4",
                 "--num-steps", "32", "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)]) == 0
    policy = phalanx.load(run)
    rec = make("pz:pz_tiny:make_mixed", num_envs=64, seed=1).reset(seed=1)
    gen = torch.Generator().manual_seed(0)
    actions = policy.act(rec.obs, greedy=False, generator=gen)
    assert int(actions[:, :2].max()) <= 1 and int(actions[:, 2].max()) == 2  # sampled: only the leader takes action 2
    assert main(["train", "--env", "pz:pz_tiny:make_mixed", "--model", "lstm", "--total-steps", "64",
                 "--run-dir", str(tmp_path / "lstm")]) == 2


def test_every_pz_env_starts_from_the_prefix_training_defaults_under_the_users(printed_config):
    def resolved(*flags):
        return printed_config("pz:mpe2.simple_spread_v3:parallel_env", *flags)

    pytest.importorskip("mpe2")
    rows = resolved()
    name = "env 'pz:mpe2.simple_spread_v3:parallel_env' defaults"
    assert rows["norm_value"] == (True, name) and rows["ent_coef"] == (0.01, name)
    assert rows["norm_obs"] == (True, name) and rows["lr"] == (7e-4, name)
    assert rows["num_envs"][1] == "schema"
    rows = resolved("--norm-value", "false", "--ent-coef", "0")
    assert rows["norm_value"] == (False, "command line") and rows["ent_coef"] == (0.0, "command line")
    # A name registered with its own spec keeps its own defaults (a tuned gym task's), not its prefix's; a prefix
    # without defaults gives none.
    from phalanx.envs import registry

    assert registry.train_defaults("gym:LunarLander-v3")["num_envs"] == 16
    assert registry.train_defaults("gym:CartPole-v1") == {}
