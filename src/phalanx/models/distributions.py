"""Action distributions as pure tensor functions, sampled from an explicit generator
(or its `phalanx.draws.Draws`, which a compiled rollout step replays).

Sampling goes through the caller's `torch.Generator` (never the global RNG) so that a resumed run
draws the same actions as the uninterrupted one.

Action masks (`StepRecord.action_mask`, docs/ENVIRONMENTS.md): `masked_logits` gives a forbidden action the
logit `MASKED_LOGIT`, whose probability underflows to exactly 0, so `categorical_log_prob` and
`categorical_entropy` of masked logits are over the legal set, renormalised, and no gradient reaches a
forbidden action's logit; `masked_categorical_sample` and `masked_argmax` never pick a forbidden action.
A mask of None allows every action: each function is then the unmasked one, to the bit.
"""

from __future__ import annotations

import math

import torch

from phalanx.consts import constant
from phalanx.draws import Source, normal, uniform

_NEG = -1e9  # padding logit for multi-discrete heads of unequal size; finite so p*log(p) stays 0
MASKED_LOGIT = _NEG  # an action a slot may not take


def categorical_sample(logits: torch.Tensor, generator: Source) -> torch.Tensor:
    u = uniform(generator, logits.shape, logits.device, logits.dtype)
    # Gumbel-max: argmax(logits + G) with G = -log(-log u), written as a difference (the same numbers, three
    # operations fewer a step than with clamps). u = 0 (a 2^-24 chance) gives -inf: never drawn.
    return (logits - torch.log(u).neg_().log_()).argmax(-1)


def masked_categorical_sample(logits: torch.Tensor, mask: torch.Tensor | None, generator: Source) -> torch.Tensor:
    """`categorical_sample` over the actions `mask` allows (bool, like `logits`): the same draws, so the same
    action where every action is allowed, and never a forbidden one, whatever the logits."""
    if mask is None:
        return categorical_sample(logits, generator)
    u = uniform(generator, logits.shape, logits.device, logits.dtype)
    scores = logits - torch.log(u).neg_().log_()
    # A legal action that drew u = 0 scores -inf: the lowest finite score keeps it above every forbidden one.
    return torch.where(mask, scores.clamp_min(torch.finfo(scores.dtype).min), -math.inf).argmax(-1)


def masked_argmax(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The most likely allowed action (greedy play)."""
    if mask is None:
        return logits.argmax(-1)
    return torch.where(mask, logits, -math.inf).argmax(-1)


def masked_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`logits` with the actions `mask` forbids at `MASKED_LOGIT`: the log-probabilities and entropy of the
    result are those over the allowed actions, renormalised (a forbidden action's probability is exactly 0;
    finite, so p log p stays 0 and its logit gets no gradient)."""
    return logits if mask is None else logits.masked_fill(~mask, _NEG)


def categorical_log_prob(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return _picked(torch.log_softmax(logits, -1), actions)


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    return _entropy(torch.log_softmax(logits, -1))


def categorical_log_prob_entropy(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both from one log-softmax (the update needs both: one softmax and its backward fewer a minibatch)."""
    logp = torch.log_softmax(logits, -1)
    return _picked(logp, actions), _entropy(logp)


def _picked(logp: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return logp.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def gaussian_sample(mean: torch.Tensor, log_std: torch.Tensor, generator: Source) -> torch.Tensor:
    noise = normal(generator, mean.shape, mean.device, mean.dtype)
    return mean + log_std.exp() * noise


def gaussian_log_prob(mean: torch.Tensor, log_std: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    var = torch.exp(2 * log_std)
    lp = -((actions - mean) ** 2) / (2 * var) - log_std - 0.5 * math.log(2 * math.pi)
    return lp.sum(-1)


def gaussian_entropy(mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    ent = 0.5 + 0.5 * math.log(2 * math.pi) + log_std
    return ent.expand_as(mean).sum(-1)


def pad_multi_logits(flat: torch.Tensor, nvec: tuple[int, ...]) -> torch.Tensor:
    """[..., sum(nvec)] -> [..., len(nvec), max(nvec)] with impossible entries padded."""
    return _pad_multi(flat, nvec, _NEG)


def pad_multi_mask(flat: torch.Tensor, nvec: tuple[int, ...]) -> torch.Tensor:
    """A MultiDiscrete mask [..., sum(nvec)] (each head's allowed values in turn) laid out as
    `pad_multi_logits` lays out the logits: [..., len(nvec), max(nvec)], the padding forbidden."""
    return _pad_multi(flat, nvec, False)


def _pad_multi(flat: torch.Tensor, nvec: tuple[int, ...], fill: float | bool) -> torch.Tensor:
    k, width = len(nvec), max(nvec)
    if all(n == width for n in nvec):
        return flat.reshape(*flat.shape[:-1], k, width)
    index = constant(tuple(sum(nvec[:i]) + j if j < n else 0 for i, n in enumerate(nvec) for j in range(width)),
                     flat.device, torch.long)
    valid = constant(tuple(j < n for n in nvec for j in range(width)), flat.device, torch.bool)
    padded = torch.where(valid, flat[..., index], torch.full_like(flat[..., index], fill))
    return padded.reshape(*flat.shape[:-1], k, width)
