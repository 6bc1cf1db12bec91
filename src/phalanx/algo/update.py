"""One PPO update, in the order it runs, as functions of tensors:

1. `advantages`: GAE over the rollout by the boundary table (docs/DESIGN.md section 2), and which samples train;
2. `normalised_values`: the values and returns in the critic's units where it learns normalised values;
3. `ppo_batch`: the rollout laid out for minibatches;
4. `ppo_update` (algo/ppo.py): epochs of shuffled minibatch steps, each the losses (`ppo_losses`), the backward,
   the global-norm clip and Adam (`minibatch_step`).

`update_on_rollout` runs the four; the trainer calls it once an iteration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

import torch

from phalanx.algo.gae import GAEParams, compute_gae, pending_bootstrap
from phalanx.algo.normalize import RunningMeanStd
from phalanx.algo.ppo import PPOBatch, PPOParams, StepFn, ppo_update
from phalanx.episodes import frame_index


def advantages(buf: dict[str, torch.Tensor], acts_after: torch.Tensor,
               gae: GAEParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, returns, trained) [T, N, A] of a rollout's buffers; `acts_after` [N, A]: the slots that act
    right after the rollout (active learner slots). `trained` is `active` less the steps whose bootstrap lies
    beyond the rollout (`pending_bootstrap`: a slot that acts at no later step, nor right after the rollout),
    which the update leaves out."""
    b = buf
    adv, ret = compute_gae(b["rewards"], b["values"], b["next_values"], b["terminated"], b["truncated"], gae.gamma,
                           gae.gae_lambda, active=b["active"], trial_end=b["trial_end"],
                           trial_bootstrap=gae.trial_bootstrap, active_after=acts_after)
    pending = pending_bootstrap(b["active"], b["terminated"], b["truncated"], acts_after, b["trial_end"],
                                gae.trial_bootstrap)
    return adv, ret, b["active"] & ~pending


def normalised_values(values: torch.Tensor, returns: torch.Tensor, trained: torch.Tensor,
                      value_norm: RunningMeanStd | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, returns) in the units the critic learns: as they are, or, with `value_norm`, normalised. The clip
    window is centred on what the critic output at collection: `values` in the units of the statistics it was
    denormalised with, i.e. before `value_norm` folds in the new returns (which it does here, in place)."""
    if value_norm is None:
        return values, returns
    values = value_norm.normalize(values)
    value_norm.update(returns, trained)
    return values, value_norm.normalize(returns)


def ppo_batch(buf: dict[str, torch.Tensor], advantages: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
              trained: torch.Tensor, recurrent: bool, slots: torch.Tensor | None) -> PPOBatch:
    """The rollout laid out for minibatches. Feed-forward: rows are (step, env) pairs with the agent
    axis whole (per-role layers see their slots; `slots` keeps only those the update trains).
    Recurrent: rows are envs, each keeping its whole [A, T] segment so the sequence forward can replay
    it from the memory stored at the rollout's start. `trained` [T, N, A] masks the samples (`advantages`)."""
    mask = trained.float()
    if recurrent:
        seg = lambda x: x.permute(1, 2, 0, *range(3, x.dim()))  # noqa: E731 [T, N, A, ...] -> [N, A, T, ...]
        obs = seg(buf["obs"])
        return PPOBatch(
            obs=obs, critic_obs=buf["states"].transpose(0, 1) if "states" in buf else obs, actions=seg(buf["actions"]),
            logprobs=seg(buf["logprobs"]), advantages=seg(advantages), returns=seg(returns), values=seg(values),
            mask=seg(mask), rows=torch.arange(obs.shape[0], device=obs.device), resets=seg(buf["resets"]),
            env_active=seg(buf["env_active"]),
        )
    flat = lambda x: (x if slots is None else x.index_select(2, slots)).flatten(0, 1)  # noqa: E731
    stored = "frames" in buf  # stacked pixels kept once: the samples index them, minibatches gather them
    obs = flat(frame_index(buf["frames"], buf["stack_restarts"]) if stored else buf["obs"])
    return PPOBatch(
        obs=obs, critic_obs=flat(buf["states"]) if "states" in buf else obs, actions=flat(buf["actions"]),
        logprobs=flat(buf["logprobs"]), advantages=flat(advantages), returns=flat(returns), values=flat(values),
        mask=flat(mask), frames=buf["frames"].flatten(0, 2) if stored else None,
    )


def update_on_rollout(
    buf: dict[str, torch.Tensor],
    acts_after: torch.Tensor,
    step: StepFn,
    hp: PPOParams,
    gae: GAEParams,
    *,
    value_norm: RunningMeanStd | None,
    recurrent: bool,
    slots: torch.Tensor | None,
    generator: torch.Generator | None,
    unmasked_if: Callable[[torch.Tensor], bool] | None = None,
    sync_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    phase: Callable[[str], AbstractContextManager[None]] | None = None,
) -> tuple[dict[str, torch.Tensor], PPOBatch]:
    """One PPO update on a rollout's buffers `buf`: advantages, value normalisation, the batch's layout and the
    epochs of minibatch `step`s. -> (mean metrics as 0-d tensors, the batch it trained on).

    `unmasked_if(trained)`, where given, says whether every sample trains: the mask then leaves the batch, so
    no mean of any minibatch tests it (a tenth of a small minibatch's ops, #27). `phase(name)` times the GAE."""
    with (phase or (lambda name: contextlib.nullcontext()))("gae"):
        adv, ret, trained = advantages(buf, acts_after, gae)
    values, ret = normalised_values(buf["values"], ret, trained, value_norm)
    batch = ppo_batch(buf, adv, ret, values, trained, recurrent, slots)
    if unmasked_if is not None and unmasked_if(trained):
        batch = replace(batch, mask=None)
    return ppo_update(step, batch, hp, generator=generator, sync_mean=sync_mean), batch
