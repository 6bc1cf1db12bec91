"""A trained policy as an ONNX graph, and the proof that it plays as the policy does (docs/EXPORT.md).

    from phalanx.export import export_onnx, lockstep
    path = export_onnx(phalanx.load("runs/cartpole"), "runs/cartpole/export/policy.onnx")
    report = lockstep("runs/cartpole", path, episodes=20)     # onnxruntime beside Policy.act, step for step

The graph is `phalanx.deployed.DeployedPolicy` exported by the PyTorch ONNX exporter (torch.export based,
`dynamo=True`; the TorchScript exporter where that one fails), constant-folded, in eval mode, with a
dynamic batch. Its I/O contract is written twice: in the ONNX file's metadata (key `phalanx.contract`)
and beside it as JSON (`policy.onnx` -> `policy.json`).

onnx, onnxruntime and onnxscript are an optional extra (`pip install 'phalanx[export]'`), imported on use.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx.checkpoint import WEIGHTS_FILE
from phalanx.deployed import (
    ACTION,
    ACTION_MASK,
    ACTIVE,
    EPISODE_START,
    MEMORY_PREFIX,
    NEXT_MEMORY_PREFIX,
    OBS,
    DeployedPolicy,
    distribution_names,
    memory_from_model,
)
from phalanx.envs import make
from phalanx.envs.spaces import Box, Discrete, MultiDiscrete, Space
from phalanx.episodes import env_ended
from phalanx.errors import ConfigError, MissingExtraError, PhalanxError, one_line
from phalanx.policy import Policy, load
from phalanx.runs import check_writable_dir
from phalanx.version import __version__

EXTRA = "export"
EXTRA_MODULES = ("onnx", "onnxruntime", "onnxscript")
DEFAULT_OPSET = 20
MIN_OPSET = 18  # the dynamo exporter's own opset; older ones go through its version converter and lose ops
CONTRACT_KEY = "phalanx.contract"
CONTRACT_FORMAT = "phalanx-onnx-policy/1"
DYNAMO, TORCHSCRIPT = "torch.onnx dynamo (torch.export)", "torch.onnx TorchScript"
# A batch other than 0 or 1 (torch.export specialises those) for tracing; the graph takes any B >= 1.
TRACE_BATCH = 2
MAX_BATCH = 1 << 20
PROBE_TOLERANCE = 1e-4


def require_export_extra() -> None:
    """MissingExtraError naming the extra where onnx, onnxruntime or onnxscript is not importable."""
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"ONNX export needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
                                f"installed: pip install 'phalanx[{EXTRA}]'")


def max_opset() -> int:
    """The newest opset this torch's exporter writes."""
    return int(getattr(getattr(torch.onnx, "_constants", None), "ONNX_MAX_OPSET", DEFAULT_OPSET))


def sidecar_path(onnx_path: str | Path) -> Path:
    """Where the contract's JSON lies beside an exported graph: policy.onnx -> policy.json."""
    return Path(onnx_path).with_suffix(".json")


def _bound(x: float) -> float | str:
    """JSON has no infinities: an unbounded side is written "inf" or "-inf"."""
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def space_json(space: Space) -> dict[str, Any]:
    """A space as the contract writes it (JSON: its type, sizes and bounds, an infinite bound as a string)."""
    if isinstance(space, Discrete):
        return {"type": "Discrete", "n": space.n, "slot_n": list(space.slot_n)}
    if isinstance(space, MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": list(space.nvec), "gates": [list(g) for g in space.gates]}
    return {"type": "Box", "shape": list(space.shape), "low": _bounds(space.low), "high": _bounds(space.high),
            "dtype": str(space.dtype).removeprefix("torch.")}


def _bounds(values: tuple[float, ...]) -> float | str | list[float | str]:
    """One number where every element shares it (a frame stack's 23,040 pixels), else one per element, row-major."""
    return _bound(values[0]) if len(set(values)) == 1 else [_bound(x) for x in values]



def _play_search(deployed: DeployedPolicy, solve_empties: int) -> str:
    """The contract's word on what the run's greedy play does that the graph leaves out (DeployedPolicy)."""
    parts = []
    if deployed.search_left_out:
        parts.append(f"{deployed.search_left_out} games played on from each move it likes (play_rollouts)")
    if deployed.solver_left_out:
        parts.append(f"its endgames solved from {solve_empties} empty cells (play_solve_empties)")
    if not parts:
        return "none"
    return "left out: the run plays greedily after " + " and ".join(parts) + "; the graph plays the net's own greedy move"

def contract(deployed: DeployedPolicy, opset: int, exporter: str) -> dict[str, Any]:
    """The I/O contract of the exported graph: what docs/EXPORT.md describes, for this run."""
    policy, cfg = deployed.policy, deployed.policy.config
    memory = {}
    for name, initial in deployed.initial_memory.items():
        zero = not bool(initial.any())
        memory[name] = {"input": MEMORY_PREFIX + name, "output": NEXT_MEMORY_PREFIX + name,
                        "initial": 0 if zero else initial.tolist()}
    if not deployed.has_value:
        value = "none: the run's critic is centralised (it reads the env's global state, which a deployed agent lacks)"
    elif cfg.norm_value:
        value = "the critic's output in normalised units (the run trained with norm_value)"
    else:
        value = "the critic's output in return units"
    return {
        "format": CONTRACT_FORMAT, "phalanx_version": __version__, "torch_version": torch.__version__,
        "exporter": exporter, "opset": opset, "env": cfg.env, "env_options": cfg.env_options, "model": cfg.model,
        "num_agents": deployed.num_agents, "checkpoint_step": policy.step,
        "observation_space": space_json(policy.observation_space), "action_space": space_json(policy.action_space),
        "observation_normalisation": {"folded_in": policy.obs_rms is not None, "clip": cfg.obs_clip if policy.obs_rms is not None else None},
        "greedy": True, "batch_axis": "batch (dynamic, >= 1); the second axis is the agent slot",
        "inputs": [s.to_json() for s in deployed.inputs], "outputs": [s.to_json() for s in deployed.outputs],
        "distribution": list(distribution_names(policy.action_space)), "value": value, "memory": memory,
        "play_search": _play_search(deployed, cfg.play_solve_empties),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter's own chatter (missing torchvision ops, deprecations, axis renames) kept off the terminal."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnx_ir", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _dynamic_shapes(count: int, batch: Any) -> tuple:
    """Axis 0 of every input is the batch, in the structure of forward(obs, *rest): rest, where there is one, a tuple."""
    return ({0: batch},) if count == 1 else ({0: batch}, tuple({0: batch} for _ in range(count - 1)))


def _export_dynamo(deployed: DeployedPolicy, path: Path, opset: int) -> None:
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    inputs = deployed.example_inputs(TRACE_BATCH)
    torch.onnx.export(deployed, inputs, str(path), dynamo=True, opset_version=opset, external_data=False, optimize=True,
                      input_names=[s.name for s in deployed.inputs], output_names=[s.name for s in deployed.outputs],
                      dynamic_shapes=_dynamic_shapes(len(inputs), batch), verbose=False)


def _export_torchscript(deployed: DeployedPolicy, path: Path, opset: int) -> None:
    names = [s.name for s in (*deployed.inputs, *deployed.outputs)]
    torch.onnx.export(deployed, deployed.example_inputs(TRACE_BATCH), str(path), dynamo=False, opset_version=opset,
                      do_constant_folding=True, input_names=[s.name for s in deployed.inputs],
                      output_names=[s.name for s in deployed.outputs], dynamic_axes={n: {0: "batch"} for n in names})


def _reason(e: BaseException) -> str:
    """The exporter's reason in one line: it wraps the cause (torch.export's, onnxscript's) in a long
    how-to-report message, so the innermost cause, without terminal colours."""
    while e.__cause__ is not None:
        e = e.__cause__
    return re.sub(r"\x1b\[[0-9;]*m", "", one_line(e))


def _probe_inputs(deployed: DeployedPolicy, batch: int) -> tuple[torch.Tensor, ...]:
    """Inputs at an episode start with random observations (pixels: random values of their dtype's range)."""
    inputs = list(deployed.example_inputs(batch))
    gen = torch.Generator().manual_seed(0)
    obs = inputs[0]
    if obs.dtype.is_floating_point:
        inputs[0] = torch.randn(obs.shape, generator=gen)
    else:
        high = int(deployed.policy.observation_space.high_tensor("cpu").max().clamp(max=255))
        inputs[0] = torch.randint(0, high + 1, obs.shape, generator=gen).to(obs.dtype)
    return tuple(inputs)


def _runs_alike(path: Path, deployed: DeployedPolicy) -> None:
    """onnxruntime loads the graph and runs it at a batch other than the traced one, with torch's shapes, and its
    distribution parameters, value and memory within 1e-4 of torch's (the lockstep proof plays whole episodes)."""
    session = onnx_session(path)
    inputs = _probe_inputs(deployed, TRACE_BATCH + 1)
    got = session.run(None, {s.name: x.numpy() for s, x in zip(deployed.inputs, inputs)})
    want = deployed.named(*inputs)
    for (name, w), g in zip(want.items(), got):
        if tuple(g.shape) != tuple(w.shape):
            raise RuntimeError(f"output '{name}' has shape {list(g.shape)} at batch {TRACE_BATCH + 1}, torch's {list(w.shape)}")
        if name != ACTION and _max_diff(g, w.numpy()) > PROBE_TOLERANCE:
            raise RuntimeError(f"output '{name}' differs from torch's by {_max_diff(g, w.numpy()):.3g}")


def _portable_where(model: Any) -> None:
    """Where over bool values (a masked_fill of a bool memory) as Where over uint8 between two Casts, in place:
    ONNX allows bool there, but onnxruntime's CPU kernel has no bool version."""
    import onnx
    from onnx import TensorProto, helper

    typed = onnx.shape_inference.infer_shapes(model).graph
    kinds = {v.name: v.type.tensor_type.elem_type for v in (*typed.value_info, *typed.input, *typed.output)}
    kinds.update({t.name: t.data_type for t in typed.initializer})
    nodes = []
    for node in model.graph.node:
        if node.op_type != "Where" or kinds.get(node.input[1]) != TensorProto.BOOL:
            nodes.append(node)
            continue
        x, y, out = (f"{node.name}_{n}_uint8" for n in ("x", "y", "out"))
        nodes += [helper.make_node("Cast", [node.input[1]], [x], to=TensorProto.UINT8),
                  helper.make_node("Cast", [node.input[2]], [y], to=TensorProto.UINT8),
                  helper.make_node("Where", [node.input[0], x, y], [out], name=node.name),
                  helper.make_node("Cast", [out], [node.output[0]], to=TensorProto.BOOL)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _finish(path: Path, terms: dict[str, Any]) -> None:
    """The exported file made portable and given its contract (metadata and the JSON beside it)."""
    import onnx

    model = onnx.load(str(path))
    _portable_where(model)
    for node in model.graph.node:  # the exporter's notes for debugging (stack traces, module paths): most of a small file
        del node.metadata_props[:]
        node.doc_string = ""
    del model.metadata_props[:]
    entry = model.metadata_props.add()
    entry.key, entry.value = CONTRACT_KEY, json.dumps(terms)
    model.doc_string = f"Phalanx policy of env '{terms['env']}' (model {terms['model']}): greedy env actions; see {CONTRACT_KEY}"
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    sidecar_path(path).write_text(json.dumps(terms, indent=2) + "\n")


def export_onnx(policy: Policy, path: str | Path, opset: int = DEFAULT_OPSET) -> Path:
    """Write `policy` as an ONNX graph at `path` (and its contract beside it, `sidecar_path`); -> `path`.

    The dynamo exporter first; where it cannot express the model, the TorchScript exporter; where neither can,
    a PhalanxError naming the model and the exporter's reason."""
    require_export_extra()
    most = max_opset()
    if not MIN_OPSET <= opset <= most:
        raise ConfigError(f"export opset (--opset) must be in [{MIN_OPSET}, {most}] (this torch's exporter); got {opset}")
    path = Path(path)
    if path.suffix != ".onnx":
        raise ConfigError(f"export path (--out) must name a .onnx file; got '{path}'")
    # A folder that cannot take the file is named before either exporter runs (they would be blamed for it).
    check_writable_dir(path.parent, what=f"export path (--out) '{path}': its folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    deployed = DeployedPolicy(policy)
    cfg = policy.config
    failures = []
    with torch.no_grad(), _quiet():
        for exporter, write in ((DYNAMO, _export_dynamo), (TORCHSCRIPT, _export_torchscript)):
            try:
                write(deployed, path, opset)
                _finish(path, contract(deployed, opset, exporter))
                _runs_alike(path, deployed)
                return path
            except Exception as e:  # the exporters and onnxruntime raise many types; each ends in one line below
                failures.append(f"{exporter}: {_reason(e)}")
                path.unlink(missing_ok=True)
                sidecar_path(path).unlink(missing_ok=True)
    raise PhalanxError(f"model '{cfg.model}' on env '{cfg.env}' ({policy.action_space.describe()}) cannot be exported to ONNX: "
                       + "; ".join(failures))


def onnx_session(path: str | Path, threads: int | None = None) -> Any:
    """An onnxruntime CPU session of an exported graph (`threads`: intra-op threads, None: torch's count)."""
    require_export_extra()
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.log_severity_level = 3
    try:
        return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own error types (NoSuchFile, InvalidProtobuf, Fail)
        raise PhalanxError(f"onnxruntime cannot load '{path}': {one_line(e)}") from None


def read_contract(path: str | Path) -> dict[str, Any]:
    """The contract an exported graph carries in its metadata."""
    require_export_extra()
    import onnx

    try:
        props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    except Exception as e:  # protobuf decode errors, a missing file
        raise PhalanxError(f"'{path}' is not a readable ONNX file: {one_line(e)}") from None
    if CONTRACT_KEY not in props:
        raise PhalanxError(f"'{path}' carries no {CONTRACT_KEY} metadata (not exported by `phalanx export`)")
    return json.loads(props[CONTRACT_KEY])


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


@torch.no_grad()
def lockstep(run: str | Path | Policy, onnx_path: str | Path, episodes: int = 20, num_envs: int = 8, seed: int = 0,
             env_options: dict[str, Any] | None = None, checkpoint: str | Path | None = None,
             max_steps: int = 100_000, tolerance: float = 1e-4) -> dict[str, Any]:
    """Play whole episodes of the run's env with onnxruntime beside `Policy.act` (greedy), on the same observations.

    `run`: a run directory (its latest checkpoint, or `checkpoint`) or a loaded `Policy`. The env takes the run's
    options, `env_options` over them. The envs step with the policy's actions; the graph carries its own memory
    (episode_start from the previous step's done flags, as `Policy.act`'s `reset`). Each step compares the
    graph's greedy actions with the policy's, its memory with the policy's own, and its distribution parameters
    and value with the torch `DeployedPolicy` given the same inputs. -> {episodes, steps, episode_starts,
    trial_ends, action_mismatches, actions_identical, max_abs_diff: {output: largest |difference|}, ...}.
    Discrete actions must be equal; Box actions within `tolerance`.
    """
    if episodes < 1 or num_envs < 1:
        raise ConfigError(f"lockstep needs episodes >= 1 and num_envs >= 1; got {episodes} and {num_envs}")
    policy = run if isinstance(run, Policy) else load(run, checkpoint=checkpoint)
    cfg = policy.config
    session = onnx_session(onnx_path)
    deployed = DeployedPolicy(policy)
    want_in = [s.name for s in deployed.inputs]
    got_in = [i.name for i in session.get_inputs()]
    if got_in != want_in:
        raise PhalanxError(f"'{onnx_path}' takes inputs {got_in}, this policy's graph {want_in}: exported from another run?")
    out_names = [o.name for o in session.get_outputs()]
    env = make(cfg.env, num_envs=num_envs, device=policy.device, seed=seed, **{**cfg.env_options, **(env_options or {})})
    A = env.num_agents
    discrete = not isinstance(policy.action_space, Box)
    compared = [n for n in out_names if n != ACTION and not n.startswith(NEXT_MEMORY_PREFIX)]
    diffs = dict.fromkeys([*([] if discrete else [ACTION]), *compared, *(n for n in out_names if n.startswith(NEXT_MEMORY_PREFIX))], 0.0)
    memory = {MEMORY_PREFIX + k: v.expand(num_envs, A, *v.shape).numpy().copy() for k, v in deployed.initial_memory.items()}
    policy.reset_memory()
    rec = env.reset(seed=seed)
    prev_done = torch.zeros(num_envs, A, dtype=torch.bool, device=env.device)
    done_episodes = steps = starts = trial_ends = mismatches = 0
    try:
        while done_episodes < episodes and steps < max_steps:
            feeds = {OBS: rec.obs.cpu().numpy()}
            if deployed.masked:
                feeds[ACTION_MASK] = rec.action_mask.cpu().numpy()
            if deployed.recurrent:
                feeds.update({EPISODE_START: prev_done.cpu().numpy(), ACTIVE: rec.active.cpu().numpy(), **memory})
            got = dict(zip(out_names, session.run(None, feeds)))
            # The graph leaves a play search out (DeployedPolicy): it is compared with the policy's play without it.
            played = deployed.policy if deployed.search_left_out or deployed.solver_left_out else policy
            actions = played.act(rec.obs, greedy=True, reset=prev_done, active=rec.active, mask=rec.action_mask)
            mine = actions.cpu().numpy()
            if discrete:
                mismatches += int(not np.array_equal(got[ACTION], mine))
            else:
                diffs[ACTION] = max(diffs[ACTION], _max_diff(got[ACTION], mine))
                mismatches += int(not np.allclose(got[ACTION], mine, rtol=0.0, atol=tolerance))
            want = deployed.named(*(torch.from_numpy(feeds[n]) for n in want_in))
            for name in compared:
                diffs[name] = max(diffs[name], _max_diff(got[name], want[name].numpy()))
            if deployed.recurrent:
                for name, t in memory_from_model(policy.memory, A).items():
                    out = NEXT_MEMORY_PREFIX + name
                    diffs[out] = max(diffs[out], _max_diff(got[out], t.cpu().numpy()))
                memory = {MEMORY_PREFIX + n[len(NEXT_MEMORY_PREFIX):]: v for n, v in got.items() if n.startswith(NEXT_MEMORY_PREFIX)}
            starts += int(prev_done.sum())
            before, rec = rec, env.step(actions)
            steps += 1
            prev_done = rec.terminated | rec.truncated
            done_episodes += int(env_ended(prev_done, before.active).sum())
            trial_ends += int(rec.trial_end.sum())
    finally:
        env.close()
    return {"env": cfg.env, "model": cfg.model, "num_envs": num_envs, "num_agents": A, "episodes": done_episodes,
            "steps": steps, "slot_steps": steps * num_envs * A, "episode_starts": starts, "trial_ends": trial_ends,
            "action_mismatches": mismatches, "actions_identical": mismatches == 0, "tolerance": tolerance,
            "max_abs_diff": diffs}


def file_sizes(onnx_path: str | Path, checkpoint: str | Path) -> dict[str, int]:
    """Bytes of the exported graph and of the checkpoint's weights (model.safetensors)."""
    return {"onnx": Path(onnx_path).stat().st_size, "safetensors": (Path(checkpoint) / WEIGHTS_FILE).stat().st_size}


__all__ = ["CONTRACT_KEY", "DEFAULT_OPSET", "EXTRA", "WEIGHTS_FILE", "contract", "export_onnx", "file_sizes", "lockstep", "max_opset",
           "onnx_session", "read_contract", "require_export_extra", "sidecar_path", "space_json"]
