"""Play a Phalanx policy exported to ONNX in a gymnasium env, with numpy, gymnasium and onnxruntime alone.

    python examples/onnx_play/play.py PACKAGE_DIR --env CartPole-v1 --episodes 10

PACKAGE_DIR is what `phalanx export RUN --package DIR` writes (policy.onnx beside its contract policy.json); a
.onnx file from `phalanx export RUN --out FILE` works too (its contract is FILE with .json). The contract names
the graph's inputs and outputs and says how a memory model's memory starts; this script feeds the graph what
Phalanx's gymnasium adapter would: the observation as [batch 1, agent slot 1, *obs] (a non-Box observation
flattened by gymnasium's `flatten`, as the adapter does), `episode_start` True on each episode's first step,
and it hands the env the graph's greedy `action` (shifted by the space's `start`, as the adapter does).

Prints one JSON line: {"env", "episodes", "returns", "lengths", "mean_return"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import onnxruntime as ort


def load(path: str | Path) -> tuple[ort.InferenceSession, dict]:
    """The graph (a package folder's policy.onnx, or a .onnx file) and its contract."""
    path = Path(path)
    onnx_path = path / "policy.onnx" if path.is_dir() else path
    if not onnx_path.is_file():
        raise SystemExit(f"play.py: no ONNX graph at '{onnx_path}' (a package folder holds policy.onnx)")
    if not onnx_path.with_suffix(".json").is_file():
        raise SystemExit(f"play.py: no contract '{onnx_path.with_suffix('.json')}' beside the graph (phalanx export writes it)")
    contract = json.loads(onnx_path.with_suffix(".json").read_text())
    return ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]), contract


def check_spaces(contract: dict, env: gym.Env) -> None:
    """The env gives what the policy was trained on: as many observation values, and its kind of action."""
    want = int(np.prod(contract["inputs"][0]["shape"][2:]))
    got = gym.spaces.flatdim(env.observation_space)
    if want != got:
        raise SystemExit(f"play.py: the policy takes {want} observation values per step; {env.spec.id} gives {got}")
    kind = {gym.spaces.Discrete: "Discrete", gym.spaces.MultiDiscrete: "MultiDiscrete", gym.spaces.Box: "Box"}
    have = kind.get(type(env.action_space))
    if have != contract["action_space"]["type"]:
        raise SystemExit(f"play.py: the policy's actions are {contract['action_space']['type']}; {env.spec.id} takes "
                         f"{env.action_space}")


def initial_memory(contract: dict, batch: int = 1) -> dict[str, np.ndarray]:
    """Each memory input as the contract says it starts ("initial": 0, or the per-slot values), for `batch` copies."""
    specs = {s["name"]: s for s in contract["inputs"]}
    memory = {}
    for field in contract["memory"].values():
        spec = specs[field["input"]]
        shape = [batch, *spec["shape"][1:]]
        memory[field["input"]] = np.broadcast_to(np.asarray(field["initial"], dtype=spec["dtype"]), shape).copy()
    return memory


def observation(env: gym.Env, obs: object, spec: dict) -> np.ndarray:
    """A gymnasium observation as the graph's `obs` input: [1, 1, *obs_shape] of its dtype."""
    if not isinstance(env.observation_space, gym.spaces.Box):
        obs = gym.spaces.flatten(env.observation_space, obs)
    return np.asarray(obs, dtype=spec["dtype"]).reshape(1, 1, *spec["shape"][2:])


def env_action(env: gym.Env, action: np.ndarray) -> object:
    """The graph's greedy action of slot 0 as the env takes it."""
    space, a = env.action_space, action[0, 0]
    if isinstance(space, gym.spaces.Discrete):
        return int(a) + int(space.start)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return a.astype(np.int64) + space.start
    return np.asarray(a, dtype=space.dtype).reshape(space.shape)


def play(session: ort.InferenceSession, contract: dict, env: gym.Env, episodes: int, seed: int) -> tuple[list[float], list[int]]:
    """Whole greedy episodes; the first reset takes `seed`, the later ones go on from the env's own generator."""
    if contract["num_agents"] != 1:
        raise SystemExit(f"play.py: this policy has {contract['num_agents']} agent slots; a gymnasium env has one")
    check_spaces(contract, env)
    inputs = {s["name"]: s for s in contract["inputs"]}
    memory_inputs = {f["input"] for f in contract["memory"].values()}
    unknown = set(inputs) - {"obs", "episode_start", "active"} - memory_inputs
    if unknown:
        raise SystemExit(f"play.py: the graph takes inputs {sorted(unknown)} this script does not know")
    outputs = [o.name for o in session.get_outputs()]
    returns, lengths = [], []
    obs, _ = env.reset(seed=seed)
    for _ in range(episodes):
        memory = initial_memory(contract)
        episode_start = np.ones((1, 1), dtype=bool)  # the graph resets the memory where this is True
        total, steps, done = 0.0, 0, False
        while not done:
            flags = {"episode_start": episode_start, "active": np.ones((1, 1), dtype=bool)}
            feeds = {"obs": observation(env, obs, inputs["obs"]), **flags, **memory}
            out = dict(zip(outputs, session.run(None, {name: feeds[name] for name in inputs})))
            memory = {f["input"]: out[f["output"]] for f in contract["memory"].values()}
            episode_start = np.zeros((1, 1), dtype=bool)
            obs, reward, terminated, truncated, _ = env.step(env_action(env, out["action"]))
            total += float(reward)
            steps += 1
            done = terminated or truncated
        returns.append(total)
        lengths.append(steps)
        obs, _ = env.reset()
    return returns, lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policy", help="a package folder (policy.onnx and policy.json) or an exported .onnx file")
    parser.add_argument("--env", default="CartPole-v1", help="the gymnasium env id [CartPole-v1]")
    parser.add_argument("--episodes", type=int, default=10, help="whole episodes to play [10]")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the first reset [0]")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        raise SystemExit(f"play.py: --episodes must be >= 1, got {args.episodes}")
    session, contract = load(args.policy)
    try:
        env = gym.make(args.env)
    except gym.error.Error as e:
        raise SystemExit(f"play.py: gymnasium cannot make '{args.env}': {str(e).splitlines()[0]}") from None
    try:
        returns, lengths = play(session, contract, env, args.episodes, args.seed)
    finally:
        env.close()
    print(json.dumps({"env": args.env, "episodes": len(returns), "returns": returns, "lengths": lengths,
                      "mean_return": float(np.mean(returns))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
