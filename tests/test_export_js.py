"""examples/onnx_play_js: an exported policy played from Node.js with onnxruntime-node, step for step against the torch
policy (Phalanx's own deployed forward) on the same observations, for a feed-forward, an LSTM, a transformer (its KV
cache carried by the script) and a masked two-slot graph. Needs `node` and the folder's node_modules (`.ci/run`
installs them where node is; `ONNXRUNTIME_NODE_INSTALL=skip npm install` by hand); skipped otherwise (issue 63)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.deployed import DeployedPolicy
from phalanx.envs import make

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "onnx_play_js"
pytestmark = [
    pytest.mark.skipif(shutil.which("node") is None, reason="no node on this machine"),
    pytest.mark.skipif(not (EXAMPLE / "node_modules" / "onnxruntime-node").is_dir(),
                       reason="examples/onnx_play_js has no node_modules (ONNXRUNTIME_NODE_INSTALL=skip npm install)"),
]
TINY = dict(num_envs=2, num_steps=16, total_steps=32, num_minibatches=1, num_epochs=1, progress=False, tensorboard=False,
            eval_episodes=0, hidden_sizes=[8, 8], lstm_hidden=8, tf_width=8, tf_heads=2, tf_layers=1, tf_horizon=4)
CASES = {
    "mlp-cartpole": dict(env="cartpole", norm_obs=True, env_options={"max_steps": 12}),
    "lstm-cartpole": dict(env="cartpole", model="lstm", env_options={"max_steps": 12}),
    "transformer-trial_nav": dict(env="trial_nav", model="transformer", env_options={"trials": 2, "max_trial_steps": 3}),
    "mlp-tictactoe": dict(env="tictactoe", model="mlp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_node_plays_the_graph_step_for_step_with_the_torch_policy(case, tmp_path):
    pytest.importorskip("onnxruntime")
    from phalanx.export import export_onnx

    run = tmp_path / "run"
    phalanx.train({**TINY, **CASES[case], "run_dir": str(run)})
    policy = phalanx.load(run)
    pkg = tmp_path / "pkg"
    export_onnx(policy, pkg / "policy.onnx")
    deployed = DeployedPolicy(policy)
    env = make(policy.config.env, num_envs=3, seed=5, **policy.config.env_options)
    rec = env.reset(seed=5)
    A = env.num_agents
    memory = [v.expand(3, A, *v.shape).clone() for v in deployed.initial_memory.values()]
    start = torch.ones(3, A, dtype=torch.bool)
    steps, want = [], []
    for _ in range(30):
        step = {"obs": rec.obs.tolist()}
        inputs = [rec.obs]
        if deployed.masked:
            step["action_mask"] = rec.action_mask.tolist()
            inputs.append(rec.action_mask)
        if deployed.recurrent:
            step.update(episode_start=start.tolist(), active=rec.active.tolist())
            inputs += [start, rec.active, *memory]
        out = deployed.named(*inputs)
        if deployed.recurrent:
            memory = [out[n] for n in out if n.startswith("next_memory.")]
        want.append(out["action"].flatten().tolist())
        steps.append(step)
        rec = env.step(out["action"])  # a turn-based game plays the mover's, whatever the waiting slot's says
        start = rec.terminated | rec.truncated
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    done = subprocess.run(["node", str(EXAMPLE / "play.mjs"), str(pkg), str(tmp_path / "steps.json")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = [json.loads(line)["action"] for line in done.stdout.splitlines()]
    assert len(got) == 30 and got == [[float(a) for a in w] for w in want]
