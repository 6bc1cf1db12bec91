"""Bring your own env: `--env package.module:factory` and the `phalanx.envs` entry points work wherever
an env name does (train, eval, resume, record, check-env), with no edit to the library."""

import json
import sys
import textwrap

import pytest

from phalanx.cli import main
from phalanx.envs import registry

ENV_SOURCE = '''
import torch

from phalanx.envs import Discrete, Box, StepRecord, VecEnv, generator_state, set_generator_state


class Reach1D(VecEnv):
    """Walk from a random cell to cell `goal` on a line of `size` cells."""

    name = "reach1d"
    observation_space = Box.uniform(-1.0, 1.0, (1,))
    action_space = Discrete(2)

    def __init__(self, num_envs=1, device="cpu", seed=0, size=8, goal=7):
        self.num_envs, self.device, self.size, self.goal = num_envs, torch.device(device), size, goal
        self.roles = self.default_roles()
        self.gen = torch.Generator(device=self.device).manual_seed(seed or 0)
        self.pos = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.t = torch.zeros(num_envs, dtype=torch.long, device=self.device)

    def _obs(self):
        return (self.pos.float() / (self.size - 1) * 2 - 1).reshape(-1, 1, 1)

    def _start(self):
        return torch.randint(0, self.goal, (self.num_envs,), generator=self.gen, device=self.device)

    def _record(self, reward, term, trunc, final_obs):
        z = torch.zeros(self.num_envs, 1, dtype=torch.bool, device=self.device)
        return StepRecord(obs=self._obs(), reward=reward, terminated=term, truncated=trunc, active=~z, trial_end=z,
                          final_obs=final_obs)

    def reset(self, seed=None):
        if seed is not None:
            self.gen.manual_seed(seed)
        self.pos, self.t = self._start(), torch.zeros_like(self.t)
        z = torch.zeros(self.num_envs, 1, device=self.device)
        return self._record(z, z.bool(), z.bool(), self._obs())

    def step(self, actions):
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        self.pos = (self.pos + actions.reshape(-1) * 2 - 1).clamp(0, self.size - 1)
        self.t += 1
        won, late = self.pos == self.goal, self.t >= 3 * self.size
        final = self._obs()
        done = won | late
        self.pos = torch.where(done, self._start(), self.pos)
        self.t = torch.where(done, 0, self.t)
        return self._record((won.float() - 0.01).reshape(-1, 1), won.reshape(-1, 1), (late & ~won).reshape(-1, 1), final)

    def state_dict(self):
        return {"pos": self.pos.clone(), "t": self.t.clone(), "rng": generator_state(self.gen)}

    def load_state_dict(self, state):
        self.pos, self.t = state["pos"].to(self.device).clone(), state["t"].to(self.device).clone()
        set_generator_state(self.gen, state["rng"])


def make(num_envs=1, device="cpu", seed=0, size=8, goal=7):
    """reach1d: walk to the goal cell."""
    return Reach1D(num_envs, device, seed, size=size, goal=goal)


def not_an_env(num_envs=1, device="cpu", seed=0):
    return "hello"
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A package `reachpkg` in a fresh directory, the current directory, as a user's project would be."""
    pkg = tmp_path / "project" / "reachpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "env.py").write_text(textwrap.dedent(ENV_SOURCE))
    monkeypatch.chdir(pkg.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m.startswith("reachpkg")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return pkg.parent


def test_plugin_env_trains_evaluates_and_resumes_from_the_command_line(user_package, capsys):
    run = user_package / "runs" / "r"
    common = ["--total-steps", "1024", "--num-envs", "8", "--num-steps", "16", "--progress", "false", "--tensorboard", "false"]
    assert main(["train", "--env", "reachpkg.env:make", "--goal", "6", *common, "--run-dir", str(run)]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["env"] == "reachpkg.env:make" and cfg["env_options"] == {"goal": 6}  # typed from the command line
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 4
    assert main(["train", "--resume", str(run), "--total-steps", "2048", "--progress", "false"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2048
    assert main(["check-env", "reachpkg.env:make", "--size", "5", "--goal", "4"]) == 0


def test_plugin_factory_options_come_from_its_signature(user_package, capsys):
    assert main(["train", "--env", "reachpkg.env:make", "--speed", "2", "--total-steps", "64", "--progress", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "phalanx: error: unknown env option 'speed' for 'reachpkg.env:make'; allowed: goal, size"


def test_entry_point_env(user_package, tmp_path, capsys):
    dist = user_package / "reachpkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: reachpkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[phalanx.envs]\nreach1d = reachpkg.env:make\n")
    sys.path.insert(0, str(user_package))
    assert "reach1d" in registry.known_names()
    run = tmp_path / "ep"
    assert main(["train", "--env", "reach1d", "--total-steps", "256", "--num-envs", "4", "--num-steps", "16",
                 "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)]) == 0
    assert json.loads((run / "config.json").read_text())["env"] == "reach1d"


@pytest.mark.parametrize("name, message", [
    ("nosuchpkg.env:make", "unknown env 'nosuchpkg.env:make'; allowed: "),
    ("reachpkg.env:nope", "env plugin 'reachpkg.env:nope': module 'reachpkg.env' has no attribute 'nope'"),
    ("reachpkg.broken:make", "env plugin 'reachpkg.broken:make' failed to import: ZeroDivisionError: division by zero"),
    ("reachpkg.env:not_an_env", "env 'reachpkg.env:not_an_env': its factory returned a str, not a phalanx.envs.VecEnv"),
    ("reachpkg.env:Discrete", "env 'reachpkg.env:Discrete': its factory raised TypeError: Discrete.__init__() got an unexpected "
                              "keyword argument 'num_envs'"),
])
def test_bad_plugins_are_one_line_errors(user_package, capsys, name, message):
    (user_package / "reachpkg" / "broken.py").write_text("x = 1 / 0\n")
    assert main(["train", "--env", name, "--total-steps", "1024", "--progress", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
