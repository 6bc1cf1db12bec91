"""The rollout buffer (the role of Stable-Baselines3's RolloutBuffer, on the device): every per-step field of a
rollout, declared once in `fields` with where its row comes from (`Field.of`, a function of the step's `Step`); the
rows the rollout writes each step (`write`, one call before the envs step and one after); the bootstrap of every
step (`bootstrap_truncated` in the step, `bootstrap` after the loop); the advantages (algo/gae.py); and the samples
laid out for the update's minibatches (`ppo_batch`: segments for memory models, rows otherwise) and run through the
model (`BatchEvaluator`).

A new per-step field (an action mask, say) is:
1. one `Field` in `fields`: its name, dtype, shape after [T, N, A], when it is kept and where its row comes from
   (`of=lambda step: step.acted_on.action_mask`); `sample=True` lays it out for the minibatches as every other
   sample field, under the same name;
2. a field of that name in `PPOBatch` (algo/ppo.py, default None), which `PPOBatch.index` gathers as the rest, and
   its use in the loss (`batch.action_mask` in `ppo_losses`) or in the forward (`BatchEvaluator`).
The rollout writes it with the rest; a field whose row comes from something a `Step` does not hold yet adds that
to `Step` (here) and sets it in `Rollout.step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from phalanx.algo.gae import GAEParams, compute_gae, pending_bootstrap
from phalanx.algo.ppo import PPOBatch
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.spaces import Box
from phalanx.episodes import frame_index, stack_restarts
from phalanx.models.protocol import ActorCritic
from phalanx.models.registry import obs_dim_of, state_dim_of


@dataclass
class Step:
    """One rollout step as the rollout knows it, where every field's row comes from (`Field.of`): what the learner
    acted on and what every slot did; then, once the envs have stepped, what they returned (`outcome` on)."""

    acted_on: StepRecord  # the record the slots acted on
    obs: torch.Tensor  # its observations as the model read them
    action: torch.Tensor  # every slot's, the other players' filled in
    logprob: torch.Tensor
    value: torch.Tensor  # V of `acted_on`, in return units
    acting: torch.Tensor  # [N, A]: the learner's slots that acted
    resets: torch.Tensor  # [N, A]: the slots whose memory reset before this step (their episode ended at the last)
    outcome: StepRecord | None = None  # what the envs returned
    done: torch.Tensor | None = None  # [N, A]: terminated or truncated at this step
    reward: torch.Tensor | None = None  # as the update trains on it (team share, normalised where configured)
    bootstrap: torch.Tensor | None = None  # V(final_obs) where truncated; None: filled in later (`bootstrap_truncated`)


def _unless_quiet(flag: Callable[[StepRecord], torch.Tensor]) -> Callable[[Step], torch.Tensor | None]:
    """A flag of the outcome, not written after a quiet record (StepRecord.quiet: all false, as `start` left them)."""
    return lambda step: None if step.outcome.quiet else flag(step.outcome)


@dataclass(frozen=True)
class Field:
    """One per-step field: [T, N, A, *shape] of `dtype` ([T, N, *shape] where `per_env`; `extra_rows` more rows
    before the first step, and step t's row is t + extra_rows). `of`: its row at a step, from the step's `Step`
    (None: not written at that step); `outcome`: read once the envs have stepped, else before (the observation may
    be the env's own buffer, which its step overwrites). `sample`: laid out for the minibatches as
    `PPOBatch.<name>`."""

    name: str
    dtype: torch.dtype
    of: Callable[[Step], torch.Tensor | None]
    shape: tuple[int, ...] = ()
    per_env: bool = False
    sample: bool = False
    extra_rows: int = 0
    outcome: bool = False

    def size(self, T: int, N: int, A: int) -> tuple[int, ...]:
        return (T + self.extra_rows, N, *(() if self.per_env else (A,)), *self.shape)


def stored_stack(env: VecEnv, model: ActorCritic) -> int:
    """The frames of a stacked pixel observation (VecEnv.frame_stack) where the rollout stores each frame once
    (a feed-forward pixel model: the sequence replay of a memory model reads whole observations), else 0."""
    return env.frame_stack if env.frame_stack > 1 and model.obs_is_image and not model.recurrent else 0


def fields(env: VecEnv, model: ActorCritic) -> list[Field]:
    """The buffer's fields for `model` on `env`: per model (memory models' episode starts and active flags),
    critic (MAPPO's global state) and frame stack (each frame once); image observations stay uint8."""
    f32, flag = torch.float32, torch.bool
    stack = stored_stack(env, model)
    if stack:  # the stacks rebuilt by index (episodes.frame_rows): each step stores its newest frame
        out = [Field("frames", torch.uint8, lambda s: s.obs[:, :, -1], env.observation_space.shape[1:],
                     extra_rows=stack - 1),
               Field("stack_restarts", flag, lambda s: stack_restarts(s.done, s.outcome.trial_end, s.acted_on.active),
                     outcome=True)]
    elif model.obs_is_image:
        out = [Field("obs", torch.uint8, lambda s: s.obs, env.observation_space.shape)]
    else:
        out = [Field("obs", f32, lambda s: s.obs, (obs_dim_of(env),))]
    space = env.action_space
    out += [Field("actions", f32 if isinstance(space, Box) else torch.long, lambda s: s.action, space.shape, sample=True),
            Field("logprobs", f32, lambda s: s.logprob, sample=True),
            Field("values", f32, lambda s: s.value),
            Field("next_values", f32, lambda s: s.bootstrap, outcome=True),
            Field("rewards", f32, lambda s: s.reward, outcome=True),
            Field("terminated", flag, _unless_quiet(lambda r: r.terminated), outcome=True),
            Field("truncated", flag, _unless_quiet(lambda r: r.truncated), outcome=True),
            Field("active", flag, lambda s: None if s.acted_on.quiet else s.acting),
            Field("trial_end", flag, _unless_quiet(lambda r: r.trial_end), outcome=True)]
    if model.recurrent:
        out += [Field("resets", flag, lambda s: s.resets, sample=True),
                Field("env_active", flag, lambda s: s.acted_on.active, sample=True)]
    if model.centralized:
        out.append(Field("states", f32, lambda s: s.acted_on.state.flatten(1), (state_dim_of(env),), per_env=True))
    if env.action_masks:  # the update evaluates each action on the mask it was sampled under
        out.append(Field("action_mask", flag, lambda s: s.acted_on.action_mask, (space.mask_width,), sample=True))
    return out


def buffer_specs(num_steps: int, env: VecEnv, model: ActorCritic,
                 num_envs: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every field of a rollout of `num_steps`, for `num_envs` envs (else the env's)."""
    N = env.num_envs if num_envs is None else num_envs
    return {f.name: (f.size(num_steps, N, env.num_agents), f.dtype) for f in fields(env, model)}


def buffer_bytes(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in specs.values())


class RolloutBuffer(Mapping[str, torch.Tensor]):
    """A rollout's fields on the device, by name (`fields`), a row for each of its `num_steps`, and what the update
    reads of them."""

    def __init__(self, num_steps: int, env: VecEnv, model: ActorCritic):
        self.fields = fields(env, model)
        T, N, A, device = num_steps, env.num_envs, env.num_agents, env.device
        self.tensors = {f.name: torch.zeros(f.size(T, N, A), dtype=f.dtype, device=device) for f in self.fields}
        # Every field's rows as views, made once: an eager step's write is one copy, not an index and a copy.
        self._rows = {k: v.unbind(0) for k, v in self.tensors.items()}
        self._written_before = [f for f in self.fields if not f.outcome]
        self._written_after = [f for f in self.fields if f.outcome]
        self.recurrent = model.recurrent
        self.turn_based = env.turn_based  # a reward on a turn the slot sat out is its last move's (compute_gae)
        self.frame_stack = stored_stack(env, model)
        self.num_agents = A
        # The learner's memory at the rollout's start, which the update replays each segment from.
        self.segment_start = model.initial_state(N * A, device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    # -- written by the rollout ------------------------------------------------------------------
    def start(self, acting: torch.Tensor, obs: torch.Tensor, memory) -> None:
        """Before a rollout's first step: the rows a quiet step leaves unwritten (StepRecord.quiet: no flag set,
        every learner slot `acting`), the older frames of the first observation `obs` where each step stores its
        newest, and the learner's `memory` as the rollout starts."""
        b = self.tensors
        for name in ("terminated", "truncated", "trial_end"):
            b[name].zero_()
        b["active"].copy_(acting)
        if self.frame_stack:
            b["frames"][: self.frame_stack - 1].copy_(obs.movedim(2, 0)[: self.frame_stack - 1])
        self.segment_start = memory.clone()

    def write(self, t: int | torch.Tensor, step: Step) -> None:
        """Row `t` of every field `step` holds: those read before the envs step (no `outcome` yet), or, once it
        holds one, those read after. `t`: an int row, or a [1] index tensor (one captured graph serves every row)."""
        for f in self._written_after if step.outcome is not None else self._written_before:
            x = f.of(step)
            if x is None:
                continue
            if isinstance(t, int):
                self._rows[f.name][t + f.extra_rows].copy_(x)
            else:
                buf = self.tensors[f.name]
                buf.index_copy_(0, t + f.extra_rows if f.extra_rows else t, x.to(buf.dtype).unsqueeze(0))

    def bootstrap_step(self, t: int, final_values: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Step t's bootstrap where a slot was truncated, after a step that left it out (a captured CPU step:
        `Rollout.finals_after_step`): `final_values` takes the row as it stands and gives it with V(final_obs) where
        truncated (`Rollout.final_values`)."""
        row = self._rows["next_values"][t]
        row.copy_(final_values(row))

    def bootstrap(self, value_after: torch.Tensor) -> None:
        """After the loop, each step's bootstrap where it was not truncated (docs/DESIGN.md section 2): the value
        step t+1 computed of the observation that follows step t, in its one forward (the same input, so the
        same value as a critic call after the env step); after the last step, `value_after`."""
        nv, trunc = self.tensors["next_values"], self.tensors["truncated"]
        nv[-1] = torch.where(trunc[-1], nv[-1], value_after)
        nv[:-1] = torch.where(trunc[:-1], nv[:-1], self.tensors["values"][1:])

    # -- read by the update ----------------------------------------------------------------------
    def advantages(self, acts_after: torch.Tensor,
                   gae: GAEParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(advantages, returns, trained) [T, N, A] by GAE (`compute_gae`); `acts_after` [N, A]: the slots that act
        right after the rollout. `trained` is `active` less the steps whose bootstrap lies beyond the rollout
        (`pending_bootstrap`: a slot that acts at no later step, nor right after it), which the update leaves out."""
        b = self.tensors
        adv, ret = compute_gae(b["rewards"], b["values"], b["next_values"], b["terminated"], b["truncated"], gae.gamma,
                               gae.gae_lambda, active=b["active"], trial_end=b["trial_end"],
                               trial_bootstrap=gae.trial_bootstrap, active_after=acts_after,
                               idle_rewards=self.turn_based)
        pending = pending_bootstrap(b["active"], b["terminated"], b["truncated"], acts_after, b["trial_end"],
                                    gae.trial_bootstrap)
        return adv, ret, b["active"] & ~pending

    def ppo_batch(self, advantages: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor | None, slots: torch.Tensor | None) -> PPOBatch:
        """The samples laid out for minibatches, with the update's `advantages`, `returns` and `values` [T, N, A]
        and `mask` (the samples that train; None: every one). Feed-forward: rows are (step, env) pairs with the
        agent axis whole (per-role layers see their slots; `slots` keeps only those the update trains). Memory
        models: rows are envs, each keeping its whole [A, T] segment so the sequence forward can replay it from
        `segment_start`."""
        b = self.tensors
        mask = None if mask is None else mask.float()
        if self.recurrent:
            seg = lambda x: x.permute(1, 2, 0, *range(3, x.dim()))  # noqa: E731 [T, N, A, ...] -> [N, A, T, ...]
            obs = seg(b["obs"])
            return PPOBatch(
                obs=obs, critic_obs=b["states"].transpose(0, 1) if "states" in b else obs, advantages=seg(advantages),
                returns=seg(returns), values=seg(values), mask=None if mask is None else seg(mask),
                rows=torch.arange(obs.shape[0], device=obs.device), **self._samples(seg))
        flat = lambda x: (x if slots is None else x.index_select(2, slots)).flatten(0, 1)  # noqa: E731
        stored = "frames" in b  # stacked pixels kept once: the samples index them, minibatches gather them
        obs = flat(frame_index(b["frames"], b["stack_restarts"]) if stored else b["obs"])
        return PPOBatch(
            obs=obs, critic_obs=flat(b["states"]) if "states" in b else obs, advantages=flat(advantages),
            returns=flat(returns), values=flat(values), mask=None if mask is None else flat(mask),
            frames=b["frames"].flatten(0, 2) if stored else None, **self._samples(flat))

    def _samples(self, layout: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f.name: layout(self.tensors[f.name]) for f in self.fields if f.sample}


class BatchEvaluator:
    """A minibatch of the rollout's samples through the current model -> (log-prob, entropy, value), float32 (the
    losses' dtype): feed-forward models in one forward; memory models replay each segment from the memory stored
    at the rollout's start (`RolloutBuffer.segment_start`, read at each call)."""

    def __init__(self, model: ActorCritic, amp: Callable[[], AbstractContextManager], buffer: RolloutBuffer):
        self.model, self.amp, self.buffer = model, amp, buffer

    def __call__(self, part: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with self.amp():
            if self.model.recurrent:
                logp, ent, value = self.sequence(part)
            else:
                logp, ent, value = self.model.evaluate_value(part.obs, part.actions, part.critic_obs, part.action_mask)
        return logp.float(), ent.float(), value.float()  # the losses stay in float32

    def sequence(self, part: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        A = self.buffer.num_agents
        slots = (part.rows.unsqueeze(1) * A + torch.arange(A, device=part.rows.device)).reshape(-1)
        start = self.buffer.segment_start.select(slots)
        logp, ent, value = self.model.evaluate_seq(part.obs, part.actions, start, part.resets, part.env_active,
                                                   idle_outputs=False, mask=part.action_mask)
        if value is None:  # memoryless critic: the global state [B, T, S] -> [B, T, A] -> [B, A, T]
            value = self.model.value(part.critic_obs).transpose(-1, -2) if self.model.centralized else self.model.value(part.critic_obs)
        return logp, ent, value
