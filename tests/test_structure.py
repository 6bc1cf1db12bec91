"""The code's structure, read from the source with `ast`: imports flow one way, and every registered
model keeps the written model interface."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from phalanx.algo import GAEParams, PPOParams
from phalanx.config import FIELDS, params_of, resolve
from phalanx.envs import make
from phalanx.models.kinds import KINDS
from phalanx.models.mlp import ActionHead
from phalanx.models.protocol import ActorCritic, FeedForwardActorCritic, RecurrentActorCritic
from phalanx.models.registry import MODELS, build_model

SRC = Path(__file__).resolve().parents[1] / "src"
# The workload zoo (paths under src/phalanx).
ZOO_DIRS = ("envs/",)
# Third-party modules a function may import on use: optional extras, or imports that cost a second
# and serve one command (TensorBoard writer, progress bar, plots, recordings, the gym/pz/vmas adapters).
LAZY_THIRD_PARTY = ("torch.utils.tensorboard", "rich", "matplotlib", "PIL", "imageio", "gymnasium", "pettingzoo",
                    "stable_baselines3", "resource", "ctypes", "optuna", "ray", "wandb", "vmas")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The project modules an import statement loads (a name imported from a package may be a submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if node.module is None or node.level:
        return []
    found = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
    if node.module in modules and len(found) < len(node.names):
        found.append(node.module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_imported(node, modules))
        graph[name] = deps - {name}
    return graph


def test_import_graph_has_no_cycle():
    graph = _graph()
    # The top-level package only hands the API on (phalanx/__init__.py); nothing inside imports names from it.
    for name, deps in graph.items():
        assert "phalanx" not in deps, f"{name} imports from the phalanx package face; import the module instead"
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_graph_sees_known_edges():
    # Guards the test above against reading nothing.
    graph = _graph()
    assert "phalanx.rollout" in graph["phalanx.trainer"]
    assert "phalanx.models.registry" in graph["phalanx.policy"]
    assert "phalanx.envs.registry" in graph["phalanx.config"]


def test_functions_import_no_project_module_and_only_listed_third_party_ones():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    if not name.startswith(LAZY_THIRD_PARTY):
                        bad.append(f"{path.relative_to(SRC)}:{node.lineno} imports {name} inside {fn.name}()")
    assert not bad, "\n".join(bad)


# -- the model interface -------------------------------------------------------------------------

def test_model_names_are_written_in_one_place():
    """models/kinds.py names the models; the code refers to its kinds (the zoo's envs may name a model as a config
    value in their training defaults, as a user's config does)."""
    names, found = set(KINDS), []
    for path in sorted((SRC / "phalanx").rglob("*.py")):
        rel = path.relative_to(SRC / "phalanx").as_posix()
        if rel == "models/kinds.py" or rel.startswith(ZOO_DIRS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, found


def test_every_hyperparameter_object_field_is_a_config_key():
    """PPOParams and GAEParams are filled from the config by their fields' names (config.params_of): no list of keys
    is copied by hand, and a field without a key would fail here rather than silently keep its default."""
    for cls in (PPOParams, GAEParams):
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in FIELDS]
        assert not missing, (cls.__name__, missing)
    cfg = resolve({"env": "cartpole", "clip_coef": 0.3, "gamma": 0.97, "target_kl": 0.02, "vf_clip_coef": 0.5})
    hp, gae = params_of(PPOParams, cfg), params_of(GAEParams, cfg)
    assert (hp.clip_coef, hp.target_kl, hp.vf_clip_coef, gae.gamma) == (0.3, 0.02, 0.5, 0.97)


def test_config_model_choices_are_the_registered_models():
    assert set(FIELDS["model"].metadata["choices"]) == set(MODELS)
    assert all(spec.kind is KINDS[name] for name, spec in MODELS.items())


ENV_FOR = {"mlp": "cartpole", "lstm": "cartpole", "transformer": "cartpole", "strategy": "duel", "cnn": "pixel_goal",
           "role_attention": "drone_swarm"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_registered_model_keeps_its_declared_interface(name):
    cfg = resolve({"env": ENV_FOR[name], "model": name, "num_envs": 2, "num_minibatches": 1, "cnn_channels": [4, 8, 8],
                   "cnn_dense": 16, "lstm_hidden": 16, "tf_width": 16})
    env = make(cfg.env, num_envs=2, seed=0, **cfg.env_options)
    model = build_model(cfg, env)
    spec = MODELS[name]
    assert isinstance(model, ActorCritic) and isinstance(model.head, ActionHead)
    assert type(model).recurrent is spec.recurrent  # declared on the class
    assert isinstance(type(model).obs_is_image, bool)
    assert isinstance(model.centralized, bool) and isinstance(model.memory_critic, bool)
    assert isinstance(model.slot_agnostic, bool)
    rec = env.reset(seed=0)
    obs = rec.obs if model.obs_is_image else rec.obs.reshape(2, env.num_agents, -1).float()
    with torch.no_grad():
        if spec.recurrent:
            assert isinstance(model, RecurrentActorCritic)
            state = model.initial_state(2 * env.num_agents)
            action, logp, value, state = model.act_step(obs, state)
            assert logp.shape == (2, env.num_agents)
            assert (value is None) is (not model.memory_critic)
            assert model.value_step(obs, state).shape == (2, env.num_agents) or not model.memory_critic
        else:
            assert isinstance(model, FeedForwardActorCritic)
            action, logp = model.act(obs)
            critic_in = rec.state.reshape(2, -1).float() if model.centralized else obs
            lp, ent, value = model.evaluate_value(obs, action, critic_in)
            assert lp.shape == ent.shape == value.shape == logp.shape == (2, env.num_agents)
            assert torch.allclose(lp, logp, atol=1e-5)
    env.close()
