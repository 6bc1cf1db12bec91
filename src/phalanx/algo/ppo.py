"""PPO losses and the update step: pure tensor functions, metrics returned as tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from phalanx.algo.adam import AdamState, adam_update, check_adam, moments
from phalanx.consts import constant


@dataclass(frozen=True)
class StepParams:
    """The settings of one minibatch step (`minibatch_step`: its losses, the gradient clip, the pieces it runs in):
    the config keys of the same names, whose defaults and meanings config.py holds (`config.params_of` fills them)."""

    clip_coef: float
    vf_coef: float
    ent_coef: float
    max_grad_norm: float
    clip_vloss: bool
    vf_clip_coef: float
    norm_adv: bool
    update_chunks: int  # 0 or 1: whole minibatches

    @property
    def value_clip(self) -> float:
        """How far a value may move from the one at collection before its loss is clipped (with `clip_vloss`)."""
        return self.vf_clip_coef or self.clip_coef


@dataclass(frozen=True)
class UpdateParams:
    """The epochs of one update (`ppo_update`: how its batch is cut into minibatch steps, when it stops early): the
    config keys of the same names, whose defaults and meanings config.py holds (`config.params_of` fills them)."""

    num_epochs: int
    num_minibatches: int  # a remainder of the rows is spread, one row each, over the first minibatches
    target_kl: float


class LossNorms(NamedTuple):
    """What a minibatch's losses are normalised by, taken over the whole minibatch so that its chunks' losses sum
    to the whole one's: the count of the samples (the masked ones left out) and the advantages' mean and std."""

    count: torch.Tensor
    adv_mean: torch.Tensor
    adv_std: torch.Tensor


def loss_norms(adv: torch.Tensor, mask: torch.Tensor | None) -> LossNorms:
    """The LossNorms of a whole minibatch's advantages and mask (as `ppo_losses` computes them given none)."""
    valid = None if mask is None else mask > 0
    count = (torch.full((), adv.numel(), dtype=adv.dtype, device=adv.device) if valid is None
             else mask.sum().clamp_min(1.0))
    mean = (adv if valid is None else torch.where(valid, adv, 0.0)).sum() / count
    centred = adv - mean
    sq = centred * centred
    return LossNorms(count, mean, torch.sqrt((sq if valid is None else torch.where(valid, sq, 0.0)).sum() / count))


# From this many rows a column [B, 1] is gathered as a vector: torch's CPU gather of rows copies one
# element a row there (a 16384-row minibatch of 131072: 125 us a column, 41 us as a vector; even at 512).
VECTOR_GATHER_MIN_ROWS = 512


@dataclass
class PPOBatch:
    """A flat batch of B samples; `mask` is 1 for active agent steps, 0 for excluded ones (no other values),
    or None where every sample is active."""

    obs: torch.Tensor
    critic_obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None
    # Memory policies: which buffer rows these are (to pick their stored memory), the episode starts
    # and the env's own active flags along each segment.
    rows: torch.Tensor | None = None
    resets: torch.Tensor | None = None
    env_active: torch.Tensor | None = None
    # Stacked pixels stored once (episodes.frame_index): `obs` holds each sample's indices into `frames`
    # [R, *frame] ([B, A, S]); `index` gathers the stacks of a minibatch.
    frames: torch.Tensor | None = None
    # The actions each sample's slot could take when it acted (StepRecord.action_mask), where the env masks.
    action_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.logprobs.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's tensors by field name; fields that are None are left out."""
        return {name: t for name in _FIELDS if (t := getattr(self, name)) is not None}

    def index(self, idx: torch.Tensor) -> PPOBatch:
        """The samples `idx`: every per-sample field gathered (a field added to the batch is gathered as these)."""
        # index_select is several times faster than advanced indexing on CPU; a critic that reads
        # the observations themselves must not gather them twice.
        def pick(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 2 and t.shape[1] == 1 and idx.shape[0] >= VECTOR_GATHER_MIN_ROWS:
                return t.view(-1).index_select(0, idx).unsqueeze(1)
            return t.index_select(0, idx)

        obs = pick(self.obs)
        if self.frames is not None:
            obs = self.frames[obs]
        critic_obs = obs if self.critic_obs is self.obs else pick(self.critic_obs)
        picked = {}
        for name in _SAMPLE_FIELDS:
            t = getattr(self, name)
            picked[name] = None if t is None else pick(t)
        return PPOBatch(obs, critic_obs, **picked)

    def trained_rows(self) -> PPOBatch:
        """The rows that hold a sample that trains (`mask`), the others dropped, and no mask where every sample left
        trains: the update's minibatches then compute on what they learn from. A turn-based game's learner acts on
        every other step, and a minibatch of its masked rows spent half its forward and backward on turns it sat out.
        Reads the mask on the host (call it where that is free: the CPU); rows, not samples, so an agent axis stays
        whole."""
        if self.mask is None or self.frames is not None or self.rows is not None:
            return self
        keep = (self.mask > 0).reshape(len(self), -1).any(1).nonzero().squeeze(1)
        part = self.index(keep)
        return dataclasses.replace(part, mask=None) if bool((part.mask > 0).all()) else part


_FIELDS = tuple(f.name for f in dataclasses.fields(PPOBatch))
# What a sample carries besides its observations (and the stored frames they index).
_SAMPLE_FIELDS = tuple(name for name in _FIELDS if name not in ("obs", "critic_obs", "frames"))


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x.mean() if mask is None else _mean_where(x, mask > 0, mask.sum().clamp_min(1.0))


def _mean_where(x: torch.Tensor, valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    # where, not multiply: 0 * inf from an excluded entry would poison the mean.
    return torch.where(valid, x, 0.0).sum() / count


def ppo_losses(
    new_logprobs: torch.Tensor,
    entropy: torch.Tensor,
    new_values: torch.Tensor,
    batch: PPOBatch,
    hp: StepParams,
    norms: LossNorms | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate, (optionally clipped) value loss and entropy bonus on one batch; the
    metrics are named by the terms they measure. With `norms` (a chunk of a minibatch): every mean is the
    chunk's sum over the whole minibatch's count and the advantages are normalised by its statistics, so the
    chunks' losses and metrics add up to the minibatch's."""
    clip_coef = hp.clip_coef
    # The hyperparameters as tensors of the losses' dtype, made once: a Python number in an op is wrapped into
    # a double tensor and cast at every call, four times an op's cost at minibatch 64 on a CPU (#27). Squares
    # as products, not pow: the same numbers, forward and backward, without the exponent's wrapping. Compiled,
    # numbers are the graph's constants already.
    def k(value: float) -> torch.Tensor | float:
        return value if torch.compiler.is_compiling() else constant(value, new_logprobs.device, new_logprobs.dtype)

    # masked_mean's arithmetic with the mask's test and count made once: eight means a minibatch, and at
    # minibatch 64 on a CPU each op costs more than its arithmetic.
    mask = batch.mask
    if norms is not None:
        valid = None if mask is None else mask > 0

        def mean_of(x: torch.Tensor) -> torch.Tensor:
            return (x if valid is None else torch.where(valid, x, 0.0)).sum() / norms.count
    elif mask is None:  # every sample active: the same sum over the same count (bit for bit), without the test
        mean_of = torch.mean
    else:
        valid = mask > 0
        count = mask.sum().clamp_min(1.0)

        def mean_of(x: torch.Tensor) -> torch.Tensor:
            return _mean_where(x, valid, count)

    adv = batch.advantages
    if hp.norm_adv and norms is not None:
        adv = (adv - norms.adv_mean) / (norms.adv_std + k(1e-8))
    elif hp.norm_adv:
        centred = adv - mean_of(adv)
        adv = centred / (torch.sqrt(mean_of(centred * centred)) + k(1e-8))
    log_ratio = new_logprobs - batch.logprobs
    ratio = log_ratio.exp()
    neg_adv = -adv
    pg1 = neg_adv * ratio
    pg2 = neg_adv * ratio.clamp(k(1 - clip_coef), k(1 + clip_coef))
    policy_loss = mean_of(torch.maximum(pg1, pg2))
    error = new_values - batch.returns
    v_loss = error * error
    # Samples whose value gradient the clip zeroes (the clipped term is the larger and is clamped).
    v_clipped_out = torch.zeros_like(v_loss, dtype=torch.bool)
    if hp.clip_vloss:
        vclip = hp.value_clip
        change = new_values - batch.values
        clipped_error = batch.values + change.clamp(k(-vclip), k(vclip)) - batch.returns
        v_clipped_loss = clipped_error * clipped_error
        v_clipped_out = (v_clipped_loss > v_loss) & (change.abs() > k(vclip))
        v_loss = torch.maximum(v_loss, v_clipped_loss)
    value_loss = mean_of(v_loss) * k(0.5)
    ent = mean_of(entropy)
    loss = policy_loss - ent * k(hp.ent_coef) + value_loss * k(hp.vf_coef)
    with torch.no_grad():
        ratio_change = ratio - k(1.0)
        approx_kl = mean_of(ratio_change - log_ratio)
        clip_fraction = mean_of((ratio_change.abs() > k(clip_coef)).to(ratio.dtype))
        value_clip_fraction = mean_of(v_clipped_out.to(ratio.dtype))
    return loss, {
        "policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(), "entropy": ent.detach(),
        "approx_kl": approx_kl, "clip_fraction": clip_fraction, "value_clip_fraction": value_clip_fraction,
        "loss": loss.detach(),
    }


def saved_bytes(evaluate: EvaluateFn, part: PPOBatch, hp: StepParams, params: list[torch.Tensor]) -> int:
    """Bytes autograd keeps for the backward of `part`'s losses (the parameters left out): the activations a
    minibatch step holds at its peak, measured by running the forward once with nothing kept after."""
    own = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent, value = evaluate(part)
        ppo_losses(logp, ent, value, part, hp)
    return sum(seen.values())


def explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    var_t = masked_mean((target - masked_mean(target, mask)) ** 2, mask)
    resid = target - pred
    var_r = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
    return torch.where(var_t > 0, 1 - var_r / var_t.clamp_min(1e-12), torch.zeros_like(var_t))


EvaluateFn = Callable[[PPOBatch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
StepFn = Callable[[PPOBatch, torch.Tensor], dict[str, torch.Tensor]]


def minibatch_step(
    evaluate: EvaluateFn,
    optimizer: AdamState,
    hp: StepParams,
    sync_grads: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> StepFn:
    """The update of one minibatch as one function of it: forward and losses, backward, the
    global-norm clip and Adam (`phalanx.algo.adam`: a torch.optim.Adam's state works too), updating the
    parameters and the optimizer's state in place. Tensor operations only (no host values), so
    `torch.compile(..., fullgraph=True)` captures it whole through `compile_step` (and a CUDA graph
    can replay it).

    `step(batch, rows)` trains on the minibatch `batch.index(rows)`: gathered inside the step, so a
    compiled step fuses the gathers into the kernels that read them. `evaluate(part)` runs the model on
    a minibatch -> (log-prob, entropy, value). Returns the losses' metrics, the unclipped gradient norm
    and `nonfinite` (1 if the loss was not finite)."""
    check_adam(optimizer)
    # Adam's state exists before the first step, so a compiled step's first call sees it as every later one
    # does (created inside that call, the step was compiled again at the second).
    moments(optimizer)
    params = optimizer.param_groups[0]["params"]

    def step(batch: PPOBatch, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        for p in params:
            p.grad = None
        if hp.update_chunks > 1:  # one piece's activations at a time; the gradients add up in .grad
            norms = loss_norms(batch.advantages.index_select(0, rows),
                               None if batch.mask is None else batch.mask.index_select(0, rows))
            metrics: dict[str, torch.Tensor] = {}
            for piece in rows.tensor_split(min(hp.update_chunks, rows.shape[0])):  # never an empty piece
                part = batch.index(piece)
                logp, ent, value = evaluate(part)
                loss, m = ppo_losses(logp, ent, value, part, hp, norms)
                loss.backward()
                metrics = m if not metrics else {k: metrics[k] + v for k, v in m.items()}
            loss = metrics["loss"]
        else:
            part = batch.index(rows)
            logp, ent, value = evaluate(part)
            loss, metrics = ppo_losses(logp, ent, value, part, hp)
            loss.backward()
        # The gradients stay in `.grad` until the next step, as with torch.optim: freeing them at the end
        # of each step (torch.autograd.grad) made glibc hand heap memory back and fault it in again, which
        # cost a quarter of CPU training time in system calls.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if sync_grads is not None:
            grads = sync_grads(grads)
        # Compiled, the per-tensor forms: inductor fuses them itself, and its kernels for torch's foreach
        # ops failed an assertion on CUDA (torch 2.11, Scheduler.reorder_loops_by_dep_pair on a
        # ForeachKernelSchedulerNode), so `--compile` could not build the update step on a GPU.
        per_tensor = torch.compiler.is_compiling()
        norms = [torch.linalg.vector_norm(g) for g in grads] if per_tensor else torch._foreach_norm(grads)
        norm = torch.linalg.vector_norm(torch.stack(norms))
        scale = (hp.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        if per_tensor:
            for g in grads:
                g.mul_(scale)
        else:
            torch._foreach_mul_(grads, scale)
        # The state is read at each step: restoring a checkpoint (or load_state_dict) replaces its tensors.
        adam_update(optimizer, grads, "per_tensor" if per_tensor else None)
        metrics["grad_norm"] = norm.detach()
        metrics["nonfinite"] = (~torch.isfinite(loss.detach())).float()
        return metrics

    return step


def compile_step(step: StepFn, **options) -> StepFn:
    """`torch.compile(step, fullgraph=True)` with autograd calls traced into the graph (Dynamo leaves
    them out by default); `options` go to torch.compile (backend, dynamic)."""
    compiled = torch.compile(step, fullgraph=True, **options)

    def run(batch: PPOBatch, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(batch, rows)

    return run


def ppo_update(
    step: StepFn,
    batch: PPOBatch,
    hp: UpdateParams,
    *,
    generator: torch.Generator | None = None,
    sync_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Epochs of shuffled minibatch steps (`step`, from `minibatch_step`); returns mean metrics as
    0-d tensors (no host sync unless `hp.target_kl` is set, which reads approx-KL once per epoch).

    Data-parallel training passes `sync_mean`, so that every process takes the same early-stopping
    decision (and averages gradients in its step)."""
    size = len(batch)
    parts = min(hp.num_minibatches, size)
    device = batch.logprobs.device
    names: list[str] = []
    sums: torch.Tensor | None = None
    steps = 0
    epochs_done = 0
    for _ in range(hp.num_epochs):
        perm = torch.randperm(size, generator=generator, device=device)
        kl_epoch = torch.zeros((), device=device) if hp.target_kl else None
        # Every sample in every epoch: a remainder is spread one row each over the first minibatches.
        for idx in perm.tensor_split(parts):
            metrics = step(batch, idx)
            # One stack and one add a minibatch for all metrics (a step replayed as a CUDA graph returns the
            # same tensors each time; the stack is the copy).
            row = torch.stack(list(metrics.values()))
            sums = row if sums is None else sums.add_(row)
            if hp.target_kl:
                kl_epoch += metrics["approx_kl"]
            steps += 1
        names = list(metrics)
        epochs_done += 1
        if hp.target_kl and sync_mean is not None:
            kl_epoch = sync_mean(kl_epoch)
        if hp.target_kl and float(kl_epoch / parts) > hp.target_kl:
            break
    out = dict(zip(names, (sums / max(steps, 1)).unbind()))
    out["nonfinite"] = sums[names.index("nonfinite")]
    out["epochs"] = torch.full((), epochs_done, dtype=torch.float32, device=device)
    out["explained_variance"] = explained_variance(batch.values, batch.returns, batch.mask)
    return out
