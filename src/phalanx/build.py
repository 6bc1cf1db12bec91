"""A training run's parts, built from its config (`build_run`); `Trainer` (trainer.py) runs the loop over them.

Everything that can refuse the config (env, options, model, slots, the memory the buffers and the update need)
comes before the global RNGs are seeded and the run directory is created and locked, so a refused config leaves
nothing behind.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from phalanx import budget, devices, graphs, runs
from phalanx import checkpoint as ckpt
from phalanx.algo import Adam, Normalizers, StepParams, UpdateParams, compile_step, minibatch_step
from phalanx.algo.ppo import StepFn
from phalanx.buffer import BatchEvaluator, RolloutBuffer
from phalanx.config import Config, params_of
from phalanx.distributed import Dist
from phalanx.envs import make
from phalanx.envs.base import VecEnv
from phalanx.envs.check import check_env
from phalanx.errors import ConfigError
from phalanx.graphs import GraphedStep
from phalanx.league import League, LeagueParams, parse_mix
from phalanx.league.seats import SwappedSides, wants_swapped_sides
from phalanx.models.protocol import ActorCritic
from phalanx.models.registry import build_model, check_model
from phalanx.policy import Policy, build_normalizers
from phalanx.profile import PhaseTimer
from phalanx.rollout import Rollout, RolloutParams, StepMode
from phalanx.slots import Teammates, opponent_slots, parse_teammates

PROBE_ENVS = 4  # envs of the copy an env is checked and measured on before the full one is built


@dataclass(eq=False)
class Run:
    """The parts of one training run, each built once by `build_run` and read by the trainer."""

    cfg: Config
    dist: Dist
    device: torch.device
    main: bool  # this process writes the run directory (the only one, or torchrun's rank 0)
    run_dir: Path
    resume: bool
    lock: runs.RunLock | None
    threads: devices.Threads
    timer: PhaseTimer
    most_envs: int | None  # the largest num_envs whose buffers fit in the free memory (None: unknown)
    env: VecEnv
    model: ActorCritic
    norms: Normalizers
    gen: torch.Generator  # the run's own draws: actions, minibatches, league players
    league: League | None  # the self-play league (`opponents`)
    rollout: Rollout  # plays the envs into `buffer`
    buffer: RolloutBuffer
    params: list[torch.Tensor]  # the trained parameters
    optimizer: Adam  # its `lr` is the learning rate now (`set_lr` changes it)
    step_hp: StepParams  # the settings `update_step` holds (update_chunks as chosen where the config left it 0)
    update_step: StepFn  # one minibatch's update (`algo.minibatch_step`; compiled or a CUDA graph where asked)
    update_hp: UpdateParams  # the epochs of minibatch steps an update runs (`algo.ppo_update`)
    update_compiled: bool
    update_slots: torch.Tensor | None  # the slots the update trains where it may leave the others out


def build_run(cfg: Config, run_dir: Path | None, resume: bool, dist: Dist, overwrite: bool = False,
              step_mode: StepMode | None = None) -> Run:
    """Every part of a run of `cfg` in `run_dir` (None: `cfg.run_dir`, else a new name), in the order that refuses a
    config before anything is left behind; whatever was built is released if a part refuses. `overwrite`: an
    earlier run's entries in `run_dir` are deleted once the run is built and holds the directory's lock. `step_mode`:
    how the rollout runs its steps (None: as --compile and --cuda-graphs say; tests give another backend)."""
    parts: dict = {}
    try:
        return _build(cfg, run_dir, resume, dist, parts, overwrite, step_mode)
    except BaseException:
        if parts.get("env") is not None:
            parts["env"].close()
        if parts.get("lock") is not None:
            parts["lock"].release()
        raise


def _build(cfg: Config, run_dir: Path | None, resume: bool, dist: Dist, parts: dict, overwrite: bool,
           step_mode: StepMode | None) -> Run:
    devices.require_torch("Phalanx", devices.TORCH_FLOOR)
    if cfg.compile:
        devices.require_torch("config key 'compile'", devices.COMPILE_FLOOR)
    if cfg.cuda_graphs:
        devices.require_torch("config key 'cuda_graphs'", devices.COMPILE_FLOOR)
    device = dist.init(devices.resolve_device(cfg.device))
    main = dist.is_main
    announce = cfg.progress and main
    if announce:
        why = " (auto: CUDA, then MPS, then CPU)" if cfg.device == "auto" else ""
        print(f"device: {device}{why}", file=sys.stderr, flush=True)
    # Every rank must agree on the run directory: rank 0's clock and tag name it.
    stamp, tag = dist.broadcast_int(int(time.time())), dist.broadcast_int(secrets.randbelow(1 << 24))
    run_dir = Path(run_dir or cfg.run_dir or runs.default_run_dir(cfg.env, stamp, tag))
    if main:  # before anything is built: a run that could never save is refused in a second
        runs.check_writable_dir(run_dir)
    if not resume:
        runs.check_fresh_run_dir(run_dir, bool(ckpt.list_checkpoints(run_dir)), overwrite)
    if dist.enabled and cfg.opponents:
        raise ConfigError("config key 'opponents' (the self-play league) is not supported with torchrun yet; train it in one process")
    env_seed = cfg.seed + 1_000_033 * dist.rank
    # A copy with a few envs comes first: the cheap part of the env contract (docs/ENVIRONMENTS.md), the
    # model, and the memory the run will hold from their sizes, so that a broken env or an impossible
    # num_envs is refused in seconds with one line (1e8 cartpole envs once took 14 GB before any check).
    env = parts["env"] = make(cfg.env, num_envs=min(cfg.num_envs, PROBE_ENVS), device=device, seed=env_seed,
                              **cfg.env_options)
    check_env(env, quick=True)
    check_model(cfg, env)
    # The initial weights (an orthogonal init's QR) round differently on other thread counts: built on one
    # thread, they are the same on every machine and whatever the threads in effect before the run.
    if device.type == "cpu":
        torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):  # the model's initial weights follow the seed; the global RNG waits
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, env).to(device)
    size = sum(p.numel() for p in model.parameters())
    rows = cfg.batch_size * env.num_agents // (cfg.num_minibatches * max(1, cfg.update_chunks))
    threads = devices.choose_threads(cfg.torch_threads, device, size * cfg.num_envs * env.num_agents, size * rows,
                                     dist.local_world)
    torch.set_num_threads(threads.collect)
    if announce:
        print(f"torch threads: {threads}", file=sys.stderr, flush=True)
    fits = budget.check_memory(cfg.num_envs, cfg.num_steps, env, env.reset(seed=env_seed), model, device, announce)
    if env.num_envs != cfg.num_envs:
        env.close()
        env = parts["env"] = make(cfg.env, num_envs=cfg.num_envs, device=device, seed=env_seed, **cfg.env_options)
        check_env(env, quick=True)  # the rollout's reset(seed) starts the env afresh after it
    N, A = env.num_envs, env.num_agents
    slots = parse_teammates(cfg.teammates, env)
    if cfg.opponents:
        if cfg.teammates:
            raise ConfigError("config keys 'teammates' and 'opponents' both fill agent slots; set only one")
        parse_mix(cfg.opponents, env.scripted_names)
        opponent_slots(A, device)
    dist.broadcast_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    # The learning rate is a device tensor changed in place, and Adam's update reads no host value
    # (phalanx.algo.adam), so the step can be captured whole.
    optimizer = Adam(params, lr=torch.tensor(cfg.lr, device=device), eps=cfg.adam_eps)
    # Autocast's cache of cast weights would outlive a CUDA graph's recording: off under --cuda-graphs.
    amp = (partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16, cache_enabled=not cfg.cuda_graphs)
           if cfg.precision == "bf16" else contextlib.nullcontext)
    norms = build_normalizers(cfg, env, N, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(env_seed + 1_000_003)
    teammates = Teammates(slots, env, device) if any(slots) else None
    learner = torch.tensor([s == "" for s in slots], device=device)
    if cfg.cuda_graphs and dist.enabled:
        raise ConfigError("config key 'cuda_graphs' is not supported with torchrun yet (gradients are averaged "
                          "between ranks inside the step); train without it")
    mode = step_mode or graphs.step_mode(cfg.compile, cfg.cuda_graphs, env, device)
    league = None
    if cfg.opponents:
        learner = ~opponent_slots(A, device)
        if wants_swapped_sides(cfg.seats, env):
            env = parts["env"] = SwappedSides(env)
        learner_policy = Policy(model, norms.obs, cfg, env.observation_space, env.action_space)
        league = League(params_of(LeagueParams, cfg), env, run_dir, learner_policy, gen, host_free=mode.host_free)
    # A model that treats every slot alike lets the update leave out the slots it does not train
    # (scripted teammates, league opponents), whose loss terms are masked to zero anyway: half of
    # every update in a 1v1 league.
    partial_learner = not bool(learner.all())
    update_slots = learner.nonzero().squeeze(1) if model.slot_agnostic and partial_learner else None
    timer = PhaseTimer(device)
    # Sized before the env was built (budget.run_bytes, checked above).
    buffer = RolloutBuffer(cfg.num_steps, env, model)
    act_value = None if model.recurrent else model.act_value
    if cfg.compile and not mode.compiled and act_value is not None:  # the env's step is not capturable: the policy alone
        act_value = torch.compile(act_value, dynamic=False)
    rollout = Rollout(params_of(RolloutParams, cfg), env, model, buffer, norms, learner, gen, act_value, amp, timer,
                      teammates, league, seed=env_seed, mode=mode, steps=graphs.CapturedSteps if mode.captured else None)
    evaluate = BatchEvaluator(model, amp, buffer)
    step_hp = params_of(StepParams, cfg)
    if not cfg.update_chunks:
        need, rows = budget.minibatch_activations(evaluate, buffer, cfg.num_minibatches, step_hp, params, update_slots)
        step_hp = replace(step_hp, update_chunks=budget.auto_chunks(need, rows, device, announce))
    step = minibatch_step(evaluate, optimizer, step_hp, sync_grads=dist.average_grads if dist.enabled else None)
    if cfg.compile:
        # Shapes are fixed for the whole run (num_envs, minibatch sizes), so each compiles once (twice
        # where a remainder makes two minibatch sizes); the rollout step is captured by its mode (above).
        step = compile_step(step, dynamic=False)
    if cfg.cuda_graphs:
        step = GraphedStep(step, device)
    # Validated: now the run takes its seeds and its directory.
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % (2**32))
    random.seed(cfg.seed)
    lock = None
    if main:
        with runs.writing("run directory", run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            runs.check_run_dir(run_dir)
            lock = parts["lock"] = runs.RunLock(run_dir)
            lock.acquire()
            if overwrite:
                runs.clear_run_dir(run_dir)
    dist.barrier()
    return Run(cfg=cfg, dist=dist, device=device, main=main, run_dir=run_dir, resume=resume, lock=lock, threads=threads,
               timer=timer, most_envs=fits, env=env, model=model, norms=norms, gen=gen, league=league, rollout=rollout,
               buffer=buffer, params=params, optimizer=optimizer, step_hp=step_hp, update_step=step,
               update_hp=params_of(UpdateParams, cfg), update_compiled=cfg.compile, update_slots=update_slots)
