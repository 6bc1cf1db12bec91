"""The code's structure, read from the source with `ast`: imports flow one way, and every registered
model keeps the written model interface."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.algo import GAEParams, StepParams, UpdateParams
from phalanx.config import FIELDS, params_of, resolve
from phalanx.envs import make, registry
from phalanx.league import LeagueParams
from phalanx.model_kinds import KINDS
from phalanx.models.mlp import ActionHead
from phalanx.models.protocol import ActorCritic, FeedForwardActorCritic, RecurrentActorCritic
from phalanx.models.registry import MODELS, build_model
from phalanx.rollout import RolloutParams

SRC = Path(__file__).resolve().parents[1] / "src"
# The workload zoo (paths under src/phalanx).
ZOO_DIRS = ("zoo/",)
# Third-party modules a function may import on use: optional extras, or imports that cost a second
# and serve one command (TensorBoard writer, progress bar, plots, recordings, the gym/pz/vmas adapters).
LAZY_THIRD_PARTY = ("torch.utils.tensorboard", "rich", "matplotlib", "PIL", "imageio", "gymnasium", "pettingzoo",
                    "stable_baselines3", "resource", "ctypes", "optuna", "ray", "wandb", "vmas", "onnx", "onnxruntime",
                    "huggingface_hub", "benchmarl")


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


def _graph(runtime: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports; `runtime`: not counting `if TYPE_CHECKING:` blocks."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        if runtime:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    node.body = []
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_imported(node, modules))
        graph[name] = deps - {name}
    return graph


def _imports_of(start: list[str], graph: dict[str, set[str]]) -> set[str]:
    """Every project module importing `start` loads: the graph followed, and with each module its parent
    packages (importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first)."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(graph[name])
    return seen


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


MAX_LAYERS = 15  # issue 49: 16 layers, with config and models importing each other


def _package_graph() -> dict[str, set[str]]:
    """The import graph with each subpackage of phalanx (models, envs, algo, ...) and phalanx_bench as one node."""
    def node(name: str) -> str:
        parts = name.split(".")
        return parts[0] if parts[0] != "phalanx" else ".".join(parts[:2])

    out: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        out.setdefault(node(name), set()).update(node(d) for d in deps)
    return {n: deps - {n, "phalanx"} for n, deps in out.items()}


def test_packages_import_one_way_in_few_layers():
    """No package imports one that imports it back (models -> config -> models was the last), and the layers
    (the longest chain of imports, a leaf being layer 1) stay few."""
    graph = _package_graph()
    layer: dict[str, int] = {}

    def depth(n: str, path: tuple[str, ...]) -> int:
        if n in path:
            pytest.fail("packages import each other: " + " -> ".join((*path[path.index(n):], n)))
        if n not in layer:
            layer[n] = 1 + max((depth(d, (*path, n)) for d in sorted(graph.get(n, ()))), default=0)
        return layer[n]

    deepest = max(depth(n, ()) for n in sorted(graph))
    assert {"phalanx.models", "phalanx.config", "phalanx.envs", "phalanx_bench"} <= set(graph)
    assert deepest <= MAX_LAYERS, sorted(layer.items(), key=lambda kv: kv[1])


def test_the_graph_sees_known_edges():
    # Guards the test above against reading nothing.
    graph = _graph()
    assert "phalanx.build" in graph["phalanx.trainer"] and "phalanx.rollout" in graph["phalanx.build"]
    assert "phalanx.models.registry" in graph["phalanx.policy"]
    assert "phalanx.envs.registry" in graph["phalanx.config"]


def test_the_bench_code_has_one_home():
    """phalanx_bench holds the bench's code (the `phalanx bench` command, the reference players, the studies and
    tools); the checkout's bench/ its specs, kept results and shell wrappers, no Python (issue 64)."""
    assert not sorted((SRC.parent / "bench").rglob("*.py"))
    assert {"phalanx_bench.players.connect_four", "phalanx_bench.studies.games", "phalanx_bench.packs"} <= set(_modules())


def test_the_reference_players_import_nothing_of_phalanx():
    """phalanx_bench.players are an independent check of the games (issue 50): written apart from Phalanx's game code
    (phalanx.zoo), they import no phalanx module at all."""
    graph = _graph()
    players = sorted(n for n in graph if n.startswith("phalanx_bench.players"))
    assert len(players) >= 4
    bad = [f"{n} imports {d}" for n in players for d in sorted(graph[n]) if d == "phalanx" or d.startswith("phalanx.")]
    assert not bad, bad


def _zoo_or_adapter(name: str) -> bool:
    return name == "phalanx.zoo" or name.startswith(("phalanx.zoo.", "phalanx.envs.adapters"))


def test_config_and_algo_import_no_zoo_module_or_adapter():
    # The env protocol (phalanx.envs) stands alone: reading the config schema or running the algorithm
    # imports none of the workloads and none of the adapters; the registry imports them by name, on use.
    graph = _graph(runtime=True)
    starts = ["phalanx.config", *sorted(n for n in graph if n == "phalanx.algo" or n.startswith("phalanx.algo."))]
    assert len(starts) > 2 and {"phalanx", "phalanx.envs", "phalanx.envs.registry"} <= _imports_of(starts[:1], graph)
    for start in starts:
        bad = sorted(n for n in _imports_of([start], graph) if _zoo_or_adapter(n))
        assert not bad, f"importing {start} imports {', '.join(bad)}"


def test_the_protocol_the_adapters_and_the_zoo_import_apart():
    graph = _graph(runtime=True)
    assert not [n for n in _imports_of(["phalanx.envs"], graph) if _zoo_or_adapter(n)]
    assert not [n for n in _imports_of(["phalanx.envs.adapters"], graph) if n.startswith("phalanx.zoo")]
    assert not [n for n in _imports_of(["phalanx.zoo"], graph) if _zoo_or_adapter(n) and n != "phalanx.zoo"]


def _run_python(code: str) -> str:
    """`code` run in a fresh interpreter on this source tree; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env=env).stdout


def test_importing_the_config_imports_no_zoo_module_or_adapter():
    # (Not `'adapters' in m`: the standard library's importlib.metadata._adapters would match.)
    out = _run_python("import phalanx.config, sys; "
                      "print(sorted(m for m in sys.modules if m.startswith(('phalanx.zoo', 'phalanx.envs.adapters'))))")
    assert out.strip() == "[]", out


def test_the_registry_table_names_what_each_module_registers():
    # registry.BUILT_IN / BUILT_IN_PREFIXES (the names the registry imports a module for) against what the
    # modules register once all are imported, in a fresh process (tests register envs of their own).
    out = json.loads(_run_python(
        "import importlib, json, pkgutil, phalanx.zoo, phalanx.envs.adapters\n"
        "from phalanx.envs import registry\n"
        "for pkg in (phalanx.zoo, phalanx.envs.adapters):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
        "print(json.dumps({'envs': {n: s.factory.__module__ for n, s in registry._REGISTRY.items()},\n"
        "                  'prefixes': {p: f.__module__ for p, f in registry._PREFIX_FACTORIES.items()}}))"))
    assert out["envs"] == registry.BUILT_IN
    assert out["prefixes"] == registry.BUILT_IN_PREFIXES


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
    """model_kinds.py names the models; the code refers to its kinds (the zoo's envs may name a model as a config
    value in their training defaults, as a user's config does)."""
    names, found = set(KINDS), []
    for path in sorted((SRC / "phalanx").rglob("*.py")):
        rel = path.relative_to(SRC / "phalanx").as_posix()
        if rel == "model_kinds.py" or rel.startswith(ZOO_DIRS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, found


def test_every_hyperparameter_object_field_is_a_config_key():
    """The settings objects are filled from the config by their fields' names (config.params_of): no list of keys
    is copied by hand, and a field without a key would fail here rather than silently keep its default."""
    for cls in (StepParams, UpdateParams, GAEParams, RolloutParams, LeagueParams):
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in FIELDS]
        assert not missing, (cls.__name__, missing)
    cfg = resolve({"env": "cartpole", "clip_coef": 0.3, "gamma": 0.97, "target_kl": 0.02, "vf_clip_coef": 0.5})
    step, update, gae = params_of(StepParams, cfg), params_of(UpdateParams, cfg), params_of(GAEParams, cfg)
    assert (step.clip_coef, update.target_kl, step.vf_clip_coef, gae.gamma) == (0.3, 0.02, 0.5, 0.97)


def test_config_model_choices_are_the_registered_models():
    assert set(FIELDS["model"].metadata["choices"]) == set(MODELS)
    assert all(spec.kind is KINDS[name] for name, spec in MODELS.items())


ENV_FOR = {"mlp": "cartpole", "lstm": "cartpole", "transformer": "cartpole", "strategy": "duel", "cnn": "pixel_goal",
           "role_attention": "drone_swarm", "board": "connect_four"}


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


def _layout_entries() -> list[str]:
    """The modules and packages of src/phalanx/ as docs/LAYOUT.md lists them, top to bottom ('trainer', 'league')."""
    text = (SRC.parent / "docs" / "LAYOUT.md").read_text()
    block = text.split("```", 2)[1]
    tree = block.split("src/phalanx/\n", 1)[1].split("\nsrc/phalanx_bench/", 1)[0]
    entries = []
    for line in tree.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            entries.append(line.split()[0].removesuffix(".py").removesuffix("/"))
    return entries


def test_layout_lists_every_module_in_the_order_imports_flow():
    """docs/LAYOUT.md's tree is the import graph's order: every module and package of src/phalanx/ listed once, and
    none imports one listed above it (a package's modules import each other freely)."""
    entries = _layout_entries()
    assert len(entries) == len(set(entries)), [e for e in entries if entries.count(e) > 1]
    own = {n.split(".")[1] for n in _modules() if n.startswith("phalanx.")} - {"__main__", "version"}
    assert set(entries) == own, f"unlisted: {sorted(own - set(entries))}; gone: {sorted(set(entries) - own)}"
    place = {e: i for i, e in enumerate(entries)}
    upward = []
    for name, deps in _graph(runtime=True).items():
        if not name.startswith("phalanx.") or name.split(".")[1] not in place:
            continue
        for dep in deps:
            if dep.startswith("phalanx.") and dep.split(".")[1] in place and place[dep.split(".")[1]] < place[name.split(".")[1]]:
                upward.append(f"{name} imports {dep}")
    assert not upward, "docs/LAYOUT.md lists these below what they import: " + "; ".join(sorted(upward))


def test_the_layout_check_sees_an_upward_import(monkeypatch):
    entries = _layout_entries()
    swapped = [e for e in entries if e != "runs"]
    swapped.insert(swapped.index("checkpoint"), "runs")  # runs above checkpoint, which imports it
    monkeypatch.setattr(sys.modules[__name__], "_layout_entries", lambda: swapped)
    with pytest.raises(AssertionError, match="phalanx.checkpoint imports phalanx.runs"):
        test_layout_lists_every_module_in_the_order_imports_flow()


def test_model_constructors_default_to_the_schemas_values():
    """A model built directly (tests, notebooks) has the sizes a run of the default config builds: its constructor's
    defaults are config.default(key), one source (issue 64: they repeated about ten of the schema's literals)."""
    import inspect

    from phalanx.config import default
    from phalanx.models import board, cnn, memory, mlp, role_attention, strategy

    tied = {board.BoardActorCritic: {"channels": "board_channels", "blocks": "board_blocks", "init_log_std": "init_log_std"},
            cnn.CNNActorCritic: {"channels": "cnn_channels", "out_dim": "cnn_dense", "init_log_std": "init_log_std"},
            mlp.MLPActorCritic: {"hidden": "hidden_sizes", "activation": "activation", "init_log_std": "init_log_std"},
            role_attention.RoleAttentionActorCritic: {"width": "tf_width", "hidden_sizes": "hidden_sizes",
                                                      "relay_floor": "relay_floor", "temperature": "attn_temperature"},
            strategy.StrategyActorCritic: {"hidden": "lstm_hidden", "width": "tf_width", "layers": "tf_layers",
                                           "heads": "tf_heads", "history": "strategy_history"},
            memory.TransformerActorCritic: {"width": "tf_width", "layers": "tf_layers", "heads": "tf_heads",
                                            "horizon": "tf_horizon"}}
    for cls, params in tied.items():
        signature = inspect.signature(cls.__init__).parameters
        for param, key in params.items():
            assert signature[param].default == default(key), (cls.__name__, param, key)
    source = "".join(inspect.getsource(m) for m in (board, cnn, mlp, role_attention, strategy, memory))
    assert source.count('default("') >= 25
