"""A run's memory budget: what its envs, rollout buffers, model and update hold, checked against the device's free
memory before anything large is built, the most envs that fit, and the pieces a minibatch runs in."""

from __future__ import annotations

import math
import sys

import torch

from phalanx import devices
from phalanx.algo import StepParams, saved_bytes
from phalanx.algo.ppo import EvaluateFn
from phalanx.buffer import RolloutBuffer, buffer_bytes, buffer_specs
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.errors import ConfigError
from phalanx.models.protocol import ActorCritic

# update_chunks 0 on the CPU: a minibatch piece's activations at most this. drone_swarm's update at 1,024 envs
# (16,384-row minibatches, about 530 MiB) took 11.1 s in 4 pieces against 16.4 s whole; bucket_brigade's
# (256 envs, 17 MiB) was slower cut in 4 (0.40 against 0.32 s) and stays whole.
CPU_PIECE_BYTES = 128 * 2**20


def most_envs(num_envs: int, num_steps: int, env: VecEnv, record: StepRecord, model: ActorCritic, budget: float) -> int:
    """The largest num_envs whose `run_bytes` (rollouts of `num_steps`) fit in `budget` bytes (they grow linearly with
    num_envs); the run's `num_envs` where they do not grow with it."""
    total = lambda n: sum(run_bytes(n, num_steps, env, record, model).values())  # noqa: E731
    fixed, per_env = total(0), total(1) - total(0)
    return max(0, int((budget - fixed) // per_env)) if per_env > 0 else num_envs


def run_bytes(num_envs: int, num_steps: int, env: VecEnv, record: StepRecord, model: ActorCritic) -> dict[str, int]:
    """What a run of `num_envs` envs and rollouts of `num_steps` will hold, from a copy `env` of fewer envs (and a
    record it returned), before the full env is built: its step state and records, each tensor with a row per env
    scaled to num_envs; the rollout buffer; the model with Adam's two moments and a gradient."""
    try:
        tensors = list(env.step_state().values())
    except NotImplementedError:  # not capturable: its records are what is known of its size
        tensors = []
    tensors += list(record.tensors().values())
    scale = num_envs / env.num_envs
    env_bytes = sum(t.numel() * t.element_size() * (scale if t.dim() and t.shape[0] == env.num_envs else 1)
                    for t in tensors)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"envs": int(env_bytes), "rollout buffer": buffer_bytes(buffer_specs(num_steps, env, model, num_envs)),
            "model and optimizer": 4 * weights}


def check_memory(num_envs: int, num_steps: int, env: VecEnv, record: StepRecord, model: ActorCritic,
                 device: torch.device, announce: bool) -> int | None:
    """Refuse a run whose envs, buffers and model (`run_bytes`, from the env copy `env` and a record of it)
    would take more than 80% of the device's free memory, saying how many envs would fit; announce the rollout
    buffer's size. -> the largest num_envs whose buffers fit (`phalanx bench suite` reports it); None where free
    memory is unknown."""
    need = run_bytes(num_envs, num_steps, env, record, model)
    free = devices.free_memory_bytes(device)
    if announce:
        print(f"rollout buffer: {need['rollout buffer'] / 2**20:,.1f} MiB on {device}"
              + (f" ({free / 2**20:,.0f} MiB free)" if free is not None else ""), file=sys.stderr, flush=True)
    total = sum(need.values())
    most = None if free is None else most_envs(num_envs, num_steps, env, record, model, 0.8 * free)
    if free is not None and total > 0.8 * free:
        parts = ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in need.items())
        raise ConfigError(f"the run needs about {total / 2**20:,.0f} MiB ({parts}) but {device} has "
                          f"{free / 2**20:,.0f} MiB free; lower num_envs ({num_envs}: at most {most:,} fit "
                          f"with num_steps {num_steps}) or num_steps")
    return most


def minibatch_activations(evaluate: EvaluateFn, buffer: RolloutBuffer, num_minibatches: int, hp: StepParams,
                          params: list[torch.Tensor], slots: torch.Tensor | None) -> tuple[int, int]:
    """(bytes, rows) of one minibatch's activations at its peak: autograd's saved tensors (`saved_bytes`)
    per row, measured on 8 and 16 rows of the (still empty) rollout `buffer` so that what does not grow with
    the rows drops out, times 2 for the gradients the backward makes of them (drone_swarm at 1,024 envs:
    4 pieces lowered a run's peak by 341 MiB, where 3/4 of twice its 265 MiB of saved tensors is 398), for
    a minibatch's rows."""
    shape, device = buffer["rewards"].shape, buffer["rewards"].device
    zeros = torch.zeros(shape, device=device)
    batch = buffer.ppo_batch(zeros, zeros, zeros, torch.ones(shape, dtype=torch.bool, device=device), slots)
    rows = -(-len(batch) // min(num_minibatches, len(batch)))
    few = min(8, max(1, len(batch) // 2))
    sizes = [saved_bytes(evaluate, batch.index(torch.arange(n, device=device)), hp, params) for n in (few, 2 * few)]
    per_row = max(0, sizes[1] - sizes[0]) / few
    return int(2 * per_row * rows), rows


def auto_chunks(need: int, rows: int, device: torch.device, announce: bool) -> int:
    """update_chunks 0: the fewest pieces of a minibatch of `rows` rows whose activations (`need` bytes) fit in what
    the device has free once the run's buffers are held, and on the CPU pieces of at most `CPU_PIECE_BYTES`; says
    so where memory is why."""
    pieces = math.ceil(need / CPU_PIECE_BYTES) if device.type == "cpu" else 1
    free = devices.free_memory_bytes(device)
    if free is not None and need > 0:
        room = 0.8 * free
        if need / pieces > room:
            fit = math.ceil(need / room) if room > 0 else rows + 1
            if fit > rows:
                raise ConfigError(f"a minibatch of {rows:,} rows needs about {need / 2**20:,.0f} MiB of activations and "
                                  f"{device} has {free / 2**20:,.0f} MiB free after the rollout buffers: not even "
                                  f"one row at a time fits; lower num_envs or num_steps, or raise num_minibatches")
            pieces = fit
            if announce:
                print(f"update: a minibatch's activations (about {need / 2**20:,.0f} MiB) do not fit in the "
                      f"{free / 2**20:,.0f} MiB free: each minibatch runs in {pieces} pieces (update_chunks), the "
                      f"same update", file=sys.stderr, flush=True)
    return max(1, min(pieces, rows))
