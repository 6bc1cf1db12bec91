"""What a run carries over, by name: a checkpoint (what it holds besides the weights: optimizer moments, normalisers,
the rollout's envs and memory, the league, every RNG), written through checkpoint.py's atomic format and put back
for `--resume`; and the rollout step's state (`step_state`), which a captured step reads and replaces (graphs.py)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from phalanx import checkpoint as ckpt
from phalanx import runs
from phalanx.algo import Adam, Normalizers
from phalanx.config import Config
from phalanx.distributed import Dist
from phalanx.envs.base import StepRecord, VecEnv, generator_state, set_generator_state
from phalanx.episodes import EpisodeCounters
from phalanx.errors import CheckpointError
from phalanx.league import LEAGUE_FILE, League
from phalanx.models.protocol import ActorCritic
from phalanx.slots import Teammates


class Playing(Protocol):
    """What a rollout (rollout.Rollout) carries from one step to the next, and from a checkpoint to a resume. Named
    here, not imported, so that graphs.py, which reads both, sits one layer above the rollout."""

    device: torch.device
    env: VecEnv
    record: StepRecord  # the record acted on next
    counters: EpisodeCounters
    prev_done: torch.Tensor  # [N, A]: the slots whose memory resets at the next step
    memory: Any  # the learner's memory (models/state.py)
    teammates: Teammates | None
    league: League | None


class Checkpointed(Protocol):
    """What a checkpoint saves and puts back: the parts of a training run (build.Run) it reads."""

    cfg: Config
    dist: Dist
    main: bool  # this process writes the run directory
    run_dir: Path
    device: torch.device
    model: ActorCritic
    params: list[torch.Tensor]
    optimizer: Adam
    norms: Normalizers
    rollout: Playing
    league: League | None
    gen: torch.Generator


@dataclass
class Counters:
    """Where the loop stands: what a checkpoint records beside the tensors."""

    global_step: int = 0
    update_idx: int = 0
    recent_returns: list[float] = field(default_factory=list)


# How checkpoints lay out a rollout's memory: 1 (no "memory_layout" in the meta) kept a KV cache [layers, B, ...], 2 puts
# the slots first as the models now keep it (issue 63).
MEMORY_LAYOUT = 2


def state_tensors(run: Checkpointed) -> dict[str, torch.Tensor]:
    """Every tensor a resume needs besides the weights: optimizer moments, normalisers, the
    rollout (envs, records, episode counters, memory), the league and the RNG states."""
    out: dict[str, torch.Tensor] = {}
    for i, p in enumerate(run.params):
        for k, v in run.optimizer.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"optim.{i}.{k}"] = v
    out.update({f"norms.{k}": v for k, v in run.norms.state_dict().items()})
    out.update(rollout_tensors(run.rollout))
    if run.league is not None:
        out.update(run.league.state_tensors())
    out["trainer.rng"] = generator_state(run.gen)
    out["torch.rng"] = torch.get_rng_state()
    return out


def save(run: Checkpointed, at: Counters) -> Path:
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
        "lr": [run.optimizer.lr],
        "memory_layout": MEMORY_LAYOUT,
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


def restore(run: Checkpointed, path: Path) -> Counters:
    """Put checkpoint `path` back into `run` (weights, optimizer, learning rate, normalisers, rollout, league, RNGs);
    -> the loop's counters it was written at."""
    model_t, state_t, meta = ckpt.load_checkpoint(path)
    ckpt.check_compatible(path, meta, run.cfg.env, run.model)
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
    run.optimizer.set_lr(float(meta["lr"][0]))
    run.norms.load_state_dict(ckpt.section(state_t, "norms", dev))
    load_rollout(run.rollout, state_t, int(meta.get("memory_layout", 1)))
    if run.league is not None:
        run.league.load(_league_state(run.run_dir, path, meta), state_t)
    set_generator_state(run.gen, state_t["trainer.rng"])
    torch.set_rng_state(state_t["torch.rng"])
    pr = meta["python_rng"]
    random.setstate((pr[0], tuple(pr[1]), pr[2]))
    nr = meta["numpy_rng"]
    np.random.set_state((nr[0], np.array(nr[1], dtype=np.uint32), nr[2], nr[3], nr[4]))
    return Counters(int(meta["global_step"]), int(meta["update"]), list(meta.get("recent_returns", [])))


def rollout_tensors(rollout: Playing) -> dict[str, torch.Tensor]:
    """The envs in play, their records, episode counters and memory (keys as checkpoints store them)."""
    out = {f"env.{k}": v for k, v in rollout.env.state_dict().items()}
    rec = rollout.record
    out["record.obs"], out["record.active"] = rec.obs, rec.active
    if rec.state is not None:
        out["record.state"] = rec.state
    if rec.action_mask is not None:  # the next step acts under it: a fresh reset's mask allowed an illegal move
        out["record.action_mask"] = rec.action_mask
    out.update({f"trainer.{k}": v for k, v in rollout.counters.state_tensors().items()})
    out["trainer.prev_done"] = rollout.prev_done
    out.update({f"memory.{k}": v for k, v in rollout.memory.tensors().items()})
    return out


def load_rollout(rollout: Playing, tensors: dict[str, torch.Tensor], memory_layout: int = MEMORY_LAYOUT) -> None:
    """Put `rollout_tensors` back (from a checkpoint's tensors, on any device): new tensors, which a recorded CUDA
    graph does not read (the trainer has its steps recorded again: `Steps.forget`)."""
    dev = rollout.device
    rollout.env.load_state_dict(ckpt.section(tensors, "env"))
    rec = rollout.record
    rec.obs = tensors["record.obs"].to(dev)
    rec.active = tensors["record.active"].to(dev)
    if "record.state" in tensors:
        rec.state = tensors["record.state"].to(dev)
    if "record.action_mask" in tensors:
        rec.action_mask = tensors["record.action_mask"].to(dev)
    rollout.counters.load_state(ckpt.section(tensors, "trainer"))
    if "trainer.prev_done" in tensors:  # older checkpoints of memoryless runs lack it (it resets teammates' memory)
        rollout.prev_done = tensors["trainer.prev_done"].to(dev)
    memory = {k: v.to(dev) for k, v in ckpt.section(tensors, "memory").items()}
    if memory_layout < 2 and "k" in memory:  # a KV cache written layers first
        memory["k"], memory["v"] = memory["k"].transpose(0, 1).contiguous(), memory["v"].transpose(0, 1).contiguous()
    rollout.memory = type(rollout.memory).of(memory)


def step_state(rollout: Playing, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor a rollout step reads and may replace, by name (graphs.py): the env's `step_state`, the record
    acted on, the slots' pending resets, episode counters, the learner's, teammates' and league players' memories,
    the league's assignments and the collect's `stats`. Buffers, parameters and normalisers are written in place."""
    out = {f"env.{k}": v for k, v in rollout.env.step_state().items()}
    out.update({f"record.{k}": v for k, v in rollout.record.tensors().items()})
    out.update({f"counters.{k}": v for k, v in rollout.counters.state_tensors().items()})
    out["prev_done"] = rollout.prev_done
    out.update({f"memory.{k}": v for k, v in rollout.memory.tensors().items()})
    if rollout.teammates is not None:
        out.update({f"teammates.{k}": v for k, v in rollout.teammates.plan.step_state().items()})
    if rollout.league is not None:
        out.update({f"league.{k}": v for k, v in rollout.league.step_state().items()})
    out.update({f"stats.{k}": v for k, v in stats.items()})
    return out


def load_step_state(rollout: Playing, state: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    """Take `state` (the names of `step_state`) as the rollout's own tensors, as they are."""
    rollout.env.load_step_state(ckpt.section(state, "env"))
    rollout.record = rollout.record.with_tensors(ckpt.section(state, "record"))
    rollout.counters.load_state(ckpt.section(state, "counters"))
    rollout.prev_done = state["prev_done"]
    rollout.memory = type(rollout.memory).of(ckpt.section(state, "memory"))
    if rollout.teammates is not None:
        rollout.teammates.plan.load_step_state(ckpt.section(state, "teammates"))
    if rollout.league is not None:
        rollout.league.load_step_state(ckpt.section(state, "league"))
    stats.update(ckpt.section(state, "stats"))


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

