"""`phalanx export`: every model kind and action space as an ONNX graph that onnxruntime plays in lockstep with
`Policy.act` (docs/EXPORT.md), and the bad input it refuses in one line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx
from phalanx.cli import main
from phalanx.deployed import DeployedPolicy, memory_from_model, memory_to_model

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes `pz:pz_tiny:...` importable

# One update of a tiny model: built and barely trained, so every test trains in a fraction of a second.
TINY = dict(num_envs=2, num_steps=16, total_steps=32, num_minibatches=1, num_epochs=1, progress=False, tensorboard=False,
            eval_episodes=0, hidden_sizes=[8, 8], lstm_hidden=8, tf_width=8, tf_heads=2, tf_layers=1, tf_horizon=4,
            strategy_history=4, cnn_channels=[4, 8, 8], cnn_dense=16)

# name -> (config; what it covers). Short episodes (env options) so 20 of them take a few dozen steps.
CASES = {
    "mlp-cartpole": dict(env="cartpole", model="mlp", norm_obs=True, env_options={"max_steps": 30}),  # Discrete, obs normalised
    "mlp-pendulum": dict(env="pendulum", model="mlp", env_options={"max_steps": 10}),  # Box
    "mlp-bucket_brigade": dict(env="bucket_brigade", model="mlp", env_options={"max_nights": 6}),  # MultiDiscrete, MAPPO
    "mlp-pz_mixed": dict(env="pz:pz_tiny:make_mixed", model="mlp"),  # Discrete with per-slot counts, a slot that leaves
    "cnn-pixel_goal": dict(env="pixel_goal", model="cnn", env_options={"max_steps": 6}),  # uint8 frame stacks
    "lstm-pixel_goal": dict(env="pixel_goal", model="lstm", env_options={"max_steps": 6}),  # CNN encoder + LSTM
    "lstm-cartpole": dict(env="cartpole", model="lstm", env_options={"max_steps": 30}),
    "transformer-trial_nav": dict(env="trial_nav", model="transformer", env_options={"trials": 2, "max_trial_steps": 3}),
    "strategy-duel": dict(env="duel", model="strategy", env_options={"time_limit": 12}),
    "role_attention-drone_swarm": dict(env="drone_swarm", model="role_attention", env_options={"max_steps": 8}),  # Box, MAPPO
    # connect four's defaults: the board net with the lookahead (afterstates) and the exact outcomes narrowing the mask
    # (the searchers' int64 bitboards in the graph); it could not be exported before (issue 63)
    # (greedy play reads them deeper than training does: play_outcome_plies, in the graph too)
    "board-connect_four": dict(env="connect_four", model="board", board_channels=4, outcome_plies=2, play_outcome_plies=3),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> the run directory of CASES[name], trained once for the module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            run = tmp_path_factory.mktemp("export") / name
            phalanx.train({**TINY, **CASES[name], "run_dir": str(run)})
            made[name] = run
        return made[name]

    return get


def test_policy_act_plays_an_image_memory_model(trained):
    # Policy.act sized the memory from the preprocessed observation's leading axes, which for pixels [N, A, C, H, W]
    # are N * A * C * H, not the N * A slots.
    policy = phalanx.load(trained("lstm-pixel_goal"))
    env = phalanx.make("pixel_goal", num_envs=3, seed=0, max_steps=6)
    rec = env.reset(seed=0)
    actions = policy.act(rec.obs, reset=torch.zeros(3, 1, dtype=torch.bool), active=rec.active)
    assert actions.shape == (3, 1)
    assert policy.memory.batch_size == 3


# -- ONNX: every model kind and action space, played in lockstep -----------------------------------------------

@pytest.fixture(scope="module")
def onnxruntime():
    return pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def exported(trained, onnxruntime):
    """name -> the policy.onnx of CASES[name], exported once for the module."""
    from phalanx.export import export_onnx

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            run = trained(name)
            made[name] = export_onnx(phalanx.load(run), run / "export" / "policy.onnx")
        return made[name]

    return get


MEMORY = {"lstm": ["h", "c"], "transformer": ["k", "v", "pos", "valid"], "strategy": ["k", "v", "pos", "valid", "h", "c"]}
DISTRIBUTION = {"pendulum": ["mean", "log_std"], "drone_swarm": ["mean", "log_std"]}
CENTRALISED = ("bucket_brigade", "drone_swarm")  # MAPPO by the env's training defaults: no value output


def expected_io(name: str) -> tuple[list[str], list[str]]:
    model, env = CASES[name]["model"], CASES[name]["env"]
    memory = MEMORY.get(model, [])
    masked = env in ("connect_four", "tictactoe")
    inputs = ["obs", *(["action_mask"] if masked else []), *(["episode_start", "active"] if memory else []),
              *(f"memory.{m}" for m in memory)]
    outputs = ["action", *DISTRIBUTION.get(env, ["logits"]), *([] if env in CENTRALISED else ["value"]),
               *(f"next_memory.{m}" for m in memory)]
    return inputs, outputs


@pytest.mark.parametrize("name", list(CASES))
def test_the_graph_plays_twenty_episodes_in_lockstep_with_the_policy(name, exported):
    from phalanx.export import lockstep, onnx_session, read_contract, sidecar_path

    path = exported(name)
    session = onnx_session(path)
    inputs, outputs = expected_io(name)
    assert [i.name for i in session.get_inputs()] == inputs
    assert [o.name for o in session.get_outputs()] == outputs
    terms = read_contract(path)
    assert json.loads(sidecar_path(path).read_text()) == terms
    assert [i["name"] for i in terms["inputs"]] == inputs and [o["name"] for o in terms["outputs"]] == outputs
    assert all(m["initial"] == 0 for m in terms["memory"].values())
    assert terms["exporter"].startswith("torch.onnx dynamo")
    assert terms["checkpoint_step"] == int(sorted((path.parent.parent / "checkpoints").iterdir())[-1].name.split("_")[-1])

    report = lockstep(path.parent.parent, path, episodes=20, num_envs=3, seed=1)
    assert report["episodes"] >= 20 and report["actions_identical"], report
    assert report["episode_starts"] > 0  # memory resets before acting, exercised
    assert set(report["max_abs_diff"]) >= set(outputs) - {"action"} - ({"action"} if "mean" not in outputs else set())
    assert max(report["max_abs_diff"].values()) < 1e-4, report
    if CASES[name]["env"] == "trial_nav":
        assert report["trial_ends"] > 0  # memory kept across the trials of an episode


def test_the_batch_is_dynamic(exported):
    # Traced at batch 2; played at 1 and 5 envs, the same file.
    from phalanx.export import lockstep

    path = exported("transformer-trial_nav")
    for num_envs in (1, 5):
        report = lockstep(path.parent.parent, path, episodes=20, num_envs=num_envs, seed=num_envs)
        assert report["episodes"] >= 20 and report["actions_identical"], report
        assert max(report["max_abs_diff"].values()) < 1e-4, report


def test_episode_start_clears_the_memory_and_an_inactive_slot_keeps_it(exported):
    from phalanx.export import onnx_session

    session = onnx_session(exported("lstm-cartpole"))
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(4, 1, 4)).astype(np.float32)
    held = {f"memory.{m}": rng.normal(size=(4, 1, 8)).astype(np.float32) for m in ("h", "c")}
    zeros = {k: np.zeros_like(v) for k, v in held.items()}
    yes, no = np.ones((4, 1), bool), np.zeros((4, 1), bool)
    started = session.run(None, {"obs": obs, "episode_start": yes, "active": yes, **held})
    fresh = session.run(None, {"obs": obs, "episode_start": no, "active": yes, **zeros})
    for a, b in zip(started, fresh):
        np.testing.assert_array_equal(a, b)
    kept = session.run(None, {"obs": obs, "episode_start": no, "active": no, **held})
    np.testing.assert_array_equal(kept[-2], held["memory.h"])
    np.testing.assert_array_equal(kept[-1], held["memory.c"])
    moved = session.run(None, {"obs": obs, "episode_start": no, "active": yes, **held})
    assert not np.allclose(moved[-2], held["memory.h"])


def test_the_deployed_memory_layout_round_trips(trained):
    policy = phalanx.load(trained("strategy-duel"))
    state = policy.model.initial_state(3 * 2)
    for t in state.tensors().values():
        t.copy_(torch.arange(t.numel()).reshape(t.shape).to(t.dtype))
    deployed = memory_from_model(state, 2)
    assert deployed["k"].shape[:2] == (3, 2) and deployed["pos"].shape == (3, 2)
    back = memory_to_model(deployed, type(state))
    for name, t in state.tensors().items():
        assert torch.equal(getattr(back, name), t)


def test_the_deployed_policy_folds_in_the_observation_normalisation(trained):
    policy = phalanx.load(trained("mlp-cartpole"))
    assert policy.obs_rms is not None and not torch.allclose(policy.obs_rms.mean, torch.zeros(4, dtype=torch.float64))
    obs = torch.randn(5, 1, 4)
    out = DeployedPolicy(policy).named(obs)
    assert torch.equal(out["action"], policy.act(obs))


# -- the command line and its bad input ------------------------------------------------------------------------

def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("phalanx: error: "), err
    return err[0]


def test_export_writes_the_graph_and_says_where_and_how_big(trained, onnxruntime, capsys, tmp_path):
    run = trained("mlp-pendulum")
    assert main(["export", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'export' / 'policy.onnx'}" in out and "model.safetensors" in out and "kB" in out
    assert (run / "export" / "policy.json").is_file()
    target = tmp_path / "deep" / "pendulum.onnx"
    assert main(["export", str(run), "--out", str(target), "--opset", "18"]) == 0
    from phalanx.export import read_contract

    assert read_contract(target)["opset"] == 18 and target.with_suffix(".json").is_file()


def test_export_without_the_extra_names_it(trained, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now fails
    assert main(["export", str(trained("mlp-cartpole"))]) == 2
    line = one_error_line(capsys)
    assert "onnxruntime" in line and "pip install 'phalanx[export]'" in line


def test_export_refuses_a_run_without_a_checkpoint(trained, onnxruntime, capsys, tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "config.json").write_text((trained("mlp-cartpole") / "config.json").read_text())
    assert main(["export", str(run)]) == 2
    assert "no checkpoint" in one_error_line(capsys)
    assert main(["export", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in one_error_line(capsys)


def test_export_refuses_a_corrupt_checkpoint(trained, onnxruntime, capsys, tmp_path):
    import shutil

    run = tmp_path / "corrupt"
    shutil.copytree(trained("mlp-cartpole"), run)
    weights = next((run / "checkpoints").iterdir()) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["export", str(run)]) == 2
    assert "corrupt" in one_error_line(capsys)


def test_export_refuses_what_it_cannot_write(trained, onnxruntime, monkeypatch, capsys):
    run = str(trained("mlp-cartpole"))
    assert main(["export", run, "--opset", "9"]) == 2
    assert "opset (--opset) must be in [18, " in one_error_line(capsys)
    assert main(["export", run, "--out", "policy.txt"]) == 2
    assert "must name a .onnx file" in one_error_line(capsys)

    def cannot(*args, **kwargs):
        raise RuntimeError("Unsupported: an op the exporter cannot express\nmore detail")

    monkeypatch.setattr(torch.onnx, "export", cannot)
    assert main(["export", run]) == 2
    line = one_error_line(capsys)
    assert "model 'mlp' on env 'cartpole'" in line and "cannot be exported to ONNX" in line
    assert line.count("an op the exporter cannot express") == 2  # the dynamo and the TorchScript exporter's reasons
    assert not (Path(run) / "export" / "policy.onnx").exists()


def test_export_names_a_path_it_cannot_write_or_a_missing_checkpoint_before_exporting(trained, onnxruntime, monkeypatch,
                                                                                      capsys, tmp_path):
    """An --out under a file, in a read-only folder, or a --checkpoint that does not exist: the path and what is wrong
    with it, in one line, before either exporter runs (they blamed the model, and a missing checkpoint its meta.json).
    Issue 63, item 5: each assertion failed on main before."""
    run = trained("mlp-cartpole")
    ran = []
    monkeypatch.setattr("phalanx.export._export_dynamo", lambda *a: ran.append("dynamo"))
    monkeypatch.setattr("phalanx.export._export_torchscript", lambda *a: ran.append("torchscript"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["export", str(run), "--out", str(blocker / "policy.onnx")]) == 2
    line = one_error_line(capsys)
    assert f"export path (--out) '{blocker / 'policy.onnx'}'" in line and f"its folder '{blocker}' is a file" in line
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root writes anywhere: the check cannot fail there
            assert main(["export", str(run), "--out", str(locked / "policy.onnx")]) == 2
            assert f"export path (--out) '{locked / 'policy.onnx'}': its folder '{locked}' is not writable" in one_error_line(capsys)
    finally:
        locked.chmod(0o700)
    missing = run / "checkpoints" / "step_999"
    assert main(["export", str(run), "--checkpoint", str(missing)]) == 2
    line = one_error_line(capsys)
    assert f"checkpoint '{missing}' does not exist" in line and "meta.json" not in line
    assert ran == []


def test_where_the_dynamo_exporter_fails_the_torchscript_one_writes_the_graph(trained, onnxruntime, monkeypatch, tmp_path):
    from phalanx import export
    from phalanx.export import export_onnx, lockstep, read_contract

    def cannot(*args, **kwargs):
        raise RuntimeError("an op torch.export cannot trace")

    monkeypatch.setattr(export, "_export_dynamo", cannot)
    run = trained("lstm-cartpole")
    path = export_onnx(phalanx.load(run), tmp_path / "torchscript.onnx")
    assert read_contract(path)["exporter"] == export.TORCHSCRIPT
    report = lockstep(run, path, episodes=20, num_envs=2)
    assert report["actions_identical"] and max(report["max_abs_diff"].values()) < 1e-4, report


def test_a_constant_made_while_torch_export_traces_is_not_kept():
    """`consts.constant` caches its tensors: one first made inside torch.export's trace was a fake tensor, and the
    next eager call got it back (a fresh `phalanx export` of a bucket_brigade run failed: ".numpy() is not
    supported for tensor subclasses")."""
    from phalanx.consts import constant

    class AddsAConstant(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + constant((0.125, 4.5, 7.25), x.device)

    torch.export.export(AddsAConstant(), (torch.zeros(3),))
    made = constant((0.125, 4.5, 7.25), torch.device("cpu"))
    assert type(made) is torch.Tensor
    assert made.tolist() == [0.125, 4.5, 7.25]


def test_the_transformer_graph_writes_its_cache_without_a_full_size_scatter(trained, onnxruntime):
    """The per-layer KV-cache write exported as ScatterElements nodes with a full-size int64 index: 77% of the graph's
    time, 7x slower than `Policy.act` at batch 1,024 (issue 63; this failed on main first). The graph now writes n
    positions per layer (ScatterND) and plays in lockstep as before (test above)."""
    import onnx

    run = trained("transformer-trial_nav")
    path = phalanx.export.export_onnx(phalanx.load(run), run / "export" / "scatter.onnx")
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert "ScatterElements" not in ops, sorted(ops)


@pytest.mark.parametrize("name", ["transformer-trial_nav", "strategy-duel"])
def test_the_kv_cache_goes_from_input_to_output_through_one_scatter(name, trained, onnxruntime):
    """After the ScatterND fix the graph was still 1.9x slower than `Policy.act` at batch 1,024: the cache was
    transposed between the contract's [B, A, ...] and a layers-first model layout, split per layer, stacked, and
    reshaped into the output, each a copy of the whole cache (issue 63; this failed on main first). Now each cache
    output is made by one ScatterND whose data is the graph's input as it came, and the cache input feeds no Split or
    Concat, and no Transpose but into a MatMul (onnxruntime fuses the two: no copy)."""
    import onnx

    run = trained(name)
    graph = onnx.load(str(phalanx.export.export_onnx(phalanx.load(run), run / "export" / "cache.onnx"))).graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    for field in ("k", "v"):
        made = producer[f"next_memory.{field}"]
        assert made.op_type == "ScatterND" and made.input[0] == f"memory.{field}", (made.op_type, list(made.input))
        seen, todo = set(), [f"memory.{field}"]
        while todo:  # everything computed from the cache input by ops that only rearrange it
            t = todo.pop()
            for node in readers.get(t, []):
                assert node.op_type not in ("Split", "Concat"), (field, node.op_type, node.name)
                if node.op_type == "Transpose":
                    assert {r.op_type for r in readers[node.output[0]]} == {"MatMul"}, (field, node.name)
                if node.op_type in ("Reshape", "Flatten", "Identity") and node.output[0] not in seen:
                    seen.add(node.output[0])
                    todo.extend(node.output)
