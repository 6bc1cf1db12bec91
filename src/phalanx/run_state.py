"""A training run's checkpoint: what it holds besides the weights (optimizer moments, normalisers, the rollout's envs
and memory, the league, every RNG), written through checkpoint.py's atomic format and put back for `--resume`."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx import checkpoint as ckpt
from phalanx import runs
from phalanx.build import Run
from phalanx.envs.base import generator_state, set_generator_state
from phalanx.errors import CheckpointError
from phalanx.league import LEAGUE_FILE


@dataclass
class Counters:
    """Where the loop stands: what a checkpoint records beside the tensors."""

    global_step: int = 0
    update_idx: int = 0
    recent_returns: list[float] = field(default_factory=list)


def state_tensors(run: Run) -> dict[str, torch.Tensor]:
    """Every tensor a resume needs besides the weights: optimizer moments, normalisers, the
    rollout (envs, records, episode counters, memory), the league and the RNG states."""
    out: dict[str, torch.Tensor] = {}
    for i, p in enumerate(run.params):
        for k, v in run.optimizer.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"optim.{i}.{k}"] = v
    out.update({f"norms.{k}": v for k, v in run.norms.state_dict().items()})
    out.update(run.rollout.state_tensors())
    if run.league is not None:
        out.update(run.league.state_tensors())
    out["trainer.rng"] = generator_state(run.gen)
    out["torch.rng"] = torch.get_rng_state()
    return out


def save(run: Run, at: Counters) -> Path:
    """Checkpoint `run` at `at` (every rank takes part; rank 0 writes), with the league's file and the metric CSVs."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "env": run.cfg.env,
        "env_options": run.cfg.env_options,
        "global_step": at.global_step,
        "update": at.update_idx,
        "config": run.cfg.to_dict(),
        "model_shapes": {k: list(v.shape) for k, v in run.model.state_dict().items()},
        "lr": [run.lr],
        "recent_returns": at.recent_returns,
        "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy_rng": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    if run.league is not None:
        meta["league"] = run.league.state_json(at.global_step)
    meta["world_size"] = run.dist.world
    state = run.dist.gather_state(state_tensors(run))  # every rank takes part
    if not run.main:
        run.dist.barrier()
        return ckpt.checkpoint_path(run.run_dir, at.global_step)
    path = ckpt.save_checkpoint(run.run_dir, at.global_step, run.model.state_dict(), state, meta, run.cfg.keep_checkpoints)
    if run.league is not None:
        (run.run_dir / LEAGUE_FILE).parent.mkdir(parents=True, exist_ok=True)
        ckpt.write_json_atomic(run.run_dir / LEAGUE_FILE, meta["league"])
        run.league.prune_files()
    runs.write_metric_csvs(run.run_dir)
    run.dist.barrier()
    return path


def restore(run: Run, path: Path) -> Counters:
    """Put checkpoint `path` back into `run` (weights, optimizer, learning rate, normalisers, rollout, league, RNGs);
    -> the loop's counters it was written at."""
    model_t, state_t, meta = ckpt.load_checkpoint(path)
    ckpt.check_compatible(path, meta, run.cfg, run.model)
    saved_world = int(meta.get("world_size", 1))
    if saved_world != run.dist.world:
        raise CheckpointError(f"checkpoint '{path}' was written by {saved_world} processes; resume it with "
                              f"torchrun --nproc-per-node {saved_world} (this run has {run.dist.world})")
    state_t = run.dist.local_state(state_t)
    ckpt.load_weights(run.model, model_t, f"checkpoint '{path}'")
    dev = run.device
    for i, p in enumerate(run.params):
        st = ckpt.section(state_t, f"optim.{i}")
        if st:
            run.optimizer.state[p] = {k: v.to(device=dev, dtype=torch.float32 if k == "step" else v.dtype)
                                      for k, v in st.items()}
    set_lr(run, float(meta["lr"][0]))
    run.norms.load_state_dict(ckpt.section(state_t, "norms", dev))
    run.rollout.load_state(state_t, partial(ckpt.section, state_t))
    if run.league is not None:
        run.league.load(_league_state(run.run_dir, path, meta), state_t)
    set_generator_state(run.gen, state_t["trainer.rng"])
    torch.set_rng_state(state_t["torch.rng"])
    pr = meta["python_rng"]
    random.setstate((pr[0], tuple(pr[1]), pr[2]))
    nr = meta["numpy_rng"]
    np.random.set_state((nr[0], np.array(nr[1], dtype=np.uint32), nr[2], nr[3], nr[4]))
    return Counters(int(meta["global_step"]), int(meta["update"]), list(meta.get("recent_returns", [])))


def set_lr(run: Run, lr: float) -> None:
    """The learning rate from now on (the optimizer's device tensor, changed in place: a captured step reads it)."""
    run.lr = lr
    run.optimizer.param_groups[0]["lr"].fill_(lr)


def _league_state(run_dir: Path, path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The league state saved with the checkpoint, or league.json where it is the same step's
    state plus the games `phalanx eval` rated since."""
    if "league" not in meta:
        raise CheckpointError(f"checkpoint '{path}' has no league state; was the run trained without 'opponents'?")
    live = run_dir / LEAGUE_FILE
    try:
        data = json.loads(live.read_text())
        if data.get("step") == meta["global_step"]:
            return data
    except (OSError, json.JSONDecodeError):
        pass
    return meta["league"]

