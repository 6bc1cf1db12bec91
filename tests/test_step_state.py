"""The rollout step's state, named by contract (phalanx.graphs): what a CUDA graph records and replays.

A recorded step reads and writes the tensors it was recorded with; `run_state.step_state` names every tensor
a step reads and may replace (the env's `step_state`, records, counters, memories, the league's assignments),
and `graphs.fold` copies a step's new values back into them. These tests run the recorded step's body on the
CPU (no graph: `graphs.own_step_state`, then `graphs.folded_step` every step) and check, by walking every object the
rollout reaches, that no step leaves a tensor anywhere that the state does not name, and that the buffers
equal those of the same step run plainly, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.config import resolve
from phalanx.draws import Draws
from phalanx.envs import make, registry
from phalanx.graphs import CapturedSteps, fold, folded_step, own_memory, own_step_state
from phalanx.rollout import StepMode
from phalanx.run_state import step_state
from phalanx.slots import random_actions
from phalanx.trainer import Trainer

SMALL = dict(lstm_hidden=16, tf_width=16, tf_layers=1, tf_heads=2, tf_horizon=4, hidden_sizes=[16])
CASES = {
    "mlp": dict(model="mlp", env="cartpole", norm_obs=True, norm_reward=True, env_options={"max_steps": 5}),
    "lstm": dict(model="lstm", env="pendulum", env_options={"max_steps": 5}, **SMALL),
    "transformer": dict(model="transformer", env="trial_nav", **SMALL),
    "cnn": dict(model="cnn", env="pixel_goal", cnn_channels=[4, 8, 8], cnn_dense=16),
    "role_attention": dict(model="role_attention", env="drone_swarm", tf_width=16, hidden_sizes=[16]),
    "teammates": dict(model="mlp", env="bucket_brigade", teammates="hero,random", critic="mappo",
                      env_options={"max_nights": 5}),
    "league-mlp": dict(model="mlp", env="duel", hidden_sizes=[16]),
    "league-strategy": dict(model="strategy", env="duel", strategy_history=4, **SMALL),
    "league-lstm": dict(model="lstm", env="duel", **SMALL),
    "league-transformer": dict(model="transformer", env="duel", **SMALL),
    "teammates-transformer": dict(model="transformer", env="bucket_brigade", teammates="hero", env_options={"max_nights": 5},
                                  **SMALL),
}
LEAGUE = dict(env_options={"time_limit": 6}, opponents="self_play:2,based:1,learner:1", pool_size=2, snapshot_every=32)


def _reachable(root: object) -> dict[int, str]:
    """id -> a path of every tensor reachable from `root` through attributes, dicts, lists and tuples."""
    out: dict[int, str] = {}
    seen: set[int] = set()

    def walk(x: object, path: str, depth: int) -> None:
        if isinstance(x, torch.Tensor):
            out.setdefault(id(x), path)
            return
        if depth > 10 or id(x) in seen or isinstance(x, (torch.Generator, Draws, type, str, bytes, int, float)):
            return
        seen.add(id(x))
        if isinstance(x, dict):
            items = list(x.items())
        elif isinstance(x, (list, tuple, set)):
            items = list(enumerate(x))
        elif isinstance(x, torch.nn.Module) or hasattr(x, "__dict__") and not callable(x):
            items = list(vars(x).items())
        else:
            return
        for k, v in items:
            # Not read by a step: a CPU-only inference cache repacked after an update (never graphed), and
            # role attention's weights kept for inspection (`attention()` recomputes them).
            if k not in ("_packed_layers", "last_weights"):
                walk(v, f"{path}.{k}", depth + 1)

    walk(root, "rollout", 0)
    return out


def _trainer(tmp_path: Path, name: str, case: dict) -> Trainer:
    extra = LEAGUE if case["env"] == "duel" else {}
    # The path a graph records, run eagerly: no host reads, every league player over every env.
    return Trainer(resolve(dict(case, **extra, num_envs=4, num_steps=8, num_minibatches=2, progress=False,
                                tensorboard=False, run_dir=str(tmp_path / name))), step_mode=StepMode(static=True))


def _fold_every_step(t: Trainer) -> list[str]:
    """Run `t`'s steps as a recorded graph's body; -> the paths of tensors a step left outside the state."""
    rollout, plain = t.run.rollout, t.run.rollout.step
    strays: list[str] = []

    def folded(step_index, obs_n, stats):
        recorded = own_step_state(rollout, obs_n, stats)
        before = _reachable(rollout)
        out = folded_step(rollout, plain, step_index, recorded, stats)
        after = _reachable(rollout)
        strays.extend(path for i, path in after.items() if i not in before)
        assert out is recorded["obs_n"]
        return out

    rollout.step = folded
    return strays


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_state_names_everything_a_step_replaces(tmp_path, case):
    """Every model, with scripted teammates and with league opponents (scripted, the learner and snapshots
    entering the frozen bank, matches of 6 steps): run as a recorded step, the rollout keeps every tensor it
    held (nothing the state does not name was replaced), and fills the buffers, statistics and league
    assignments as the plain step does, bit for bit, over collects with updates between."""
    plain, recorded = _trainer(tmp_path, "plain", CASES[case]), _trainer(tmp_path, "recorded", CASES[case])
    try:
        plain.collect(), recorded.collect()  # warm-up, as a graph is recorded after it: caches filled once
        plain.update(), recorded.update()
        strays = _fold_every_step(recorded)
        for i in range(3):
            stats_p, stats_r = plain.collect(), recorded.collect()
            assert not strays, strays[:5]
            for k, buf in plain.run.buffer.items():
                assert torch.equal(buf, recorded.run.buffer[k]), (i, k)
            for k, v in stats_p.items():
                assert torch.equal(v, stats_r[k]), (i, k)
            for t in (plain, recorded):
                t.update()
                if t.run.league is not None:
                    t.run.league.end_update(32 * (i + 1), t.run.model, t.run.norms.obs)
            if plain.run.league is not None:
                assert torch.equal(plain.run.league.assign, recorded.run.league.assign), i
        if plain.run.league is not None:
            assert sum(o is not None and o.kind == "snapshot" for o in recorded.run.league.players) >= 2
    finally:
        plain.close()
        recorded.close()


def test_a_frozen_teammate_with_memory_keeps_its_memory_in_the_step_state(tmp_path):
    """A `run:` teammate with an LSTM: its memory is part of the step state (named through the teammates),
    and a recorded step leaves nothing outside it."""
    first = phalanx.train(env="bucket_brigade", model="lstm", lstm_hidden=8, hidden_sizes=[8], num_envs=4, num_steps=8,
                          total_steps=4 * 8 * 4 * 2, env_options={"max_nights": 5}, progress=False, tensorboard=False,
                          run_dir=tmp_path / "first")
    case = dict(model="mlp", env="bucket_brigade", teammates=f"run:{first.run_dir}", env_options={"max_nights": 5})
    plain, recorded = _trainer(tmp_path, "plain", case), _trainer(tmp_path, "recorded", case)
    try:
        plain.collect(), recorded.collect()
        strays = _fold_every_step(recorded)
        assert any(k.startswith("teammates.") for k in step_state(recorded.run.rollout, {}))
        for i in range(2):
            plain.collect(), recorded.collect()
            assert not strays, strays[:5]
            for k, buf in plain.run.buffer.items():
                assert torch.equal(buf, recorded.run.buffer[k]), (i, k)
    finally:
        plain.close()
        recorded.close()


ENVS = ["cartpole", "pendulum", "bucket_brigade", "drone_swarm", "pixel_goal", "duel", "trial_nav"]


@pytest.mark.parametrize("name", ENVS + ["rendezvous"])
def test_env_step_state_is_the_whole_state_and_survives_a_reload(name, monkeypatch):
    """Each capturable built-in env (and examples/rendezvous): after a step with state handed back through
    `load_step_state`, the env holds exactly those tensors; a step from a checkpointed `state_dict` gives the
    same record as the uninterrupted env."""
    if name == "rendezvous":
        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "rendezvous"))
        monkeypatch.delitem(sys.modules, "rendezvous", raising=False)
        # The name registers on first use: kept to this test, a later one imports the module afresh (a spec left
        # behind built envs from a module no longer in sys.modules, which torch.compile then could not import).
        monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
        name = "rendezvous:make"
    env, twin = make(name, num_envs=6, seed=1), make(name, num_envs=6, seed=1)
    env.reset(seed=1), twin.reset(seed=1)
    g = torch.Generator().manual_seed(0)
    env.step(random_actions(env, g))  # caches filled once (e.g. drone_swarm's fresh-episode template)
    for _ in range(40):
        state = own_memory(env.step_state())
        env.load_step_state(state)
        before = _reachable(env)
        actions = random_actions(env, g)
        env.step(actions)
        fold(state, env.step_state())
        env.load_step_state(state)
        strays = [p for i, p in _reachable(env).items() if i not in before]
        assert not strays, strays[:5]
    twin.load_state_dict(env.state_dict())
    actions = random_actions(env, g)
    a, b = env.step(actions), twin.step(actions)
    for k, v in a.tensors().items():
        assert torch.equal(v, b.tensors()[k]), k


@pytest.mark.parametrize("case", ["mlp", "lstm", "league-strategy", "teammates"])
def test_noting_the_draws_leaves_no_trace(tmp_path, case):
    """The eager step that notes a captured step's plan of draws is undone: step state, normalisers, the league's
    game counts, the generators and the env's checkpoint are as before it (so the first step after a start or a
    resume runs captured, as every later one, and a resumed --compile run follows the uninterrupted one)."""
    t = _trainer(tmp_path, "t", CASES[case])
    try:
        t.collect(), t.update()
        r = t.run.rollout
        steps = CapturedSteps(r)
        stats = r.new_stats()
        obs_n = r.obs_in(r.record.obs)
        snapshot = lambda: ({k: v.clone() for k, v in step_state(r, stats).items()},  # noqa: E731
                            {k: v.clone() for k, v in r.norms.state_dict().items()}, r.env.state_dict(),
                            [d.generator.get_state() for d in r.all_draws],
                            t.run.league.counts.clone() if t.run.league is not None else None)
        before = snapshot()
        with torch.no_grad():  # as in collect
            steps.note_draws(0, obs_n, stats)
        after = snapshot()
        assert steps.planned and before[0].keys() == after[0].keys()
        for b, a in zip(before, after):
            for k, v in (b.items() if isinstance(b, dict) else enumerate(b) if isinstance(b, list) else [("counts", b)]):
                if v is not None:
                    assert torch.equal(v, a[k] if k != "counts" else a), (case, k)
    finally:
        t.close()
