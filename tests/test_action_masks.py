"""Action masks (StepRecord.action_mask): masked distributions against a brute-force reference, the action head's
mask argument, legal random actions, and check-env's mask rules (docs/ENVIRONMENTS.md, Action masks)."""

import math
import sys
from pathlib import Path

import pytest
import torch

from phalanx.cli import main
from phalanx.draws import Draw, Draws
from phalanx.envs import Box, Discrete, MultiDiscrete, check_env
from phalanx.errors import EnvContractError
from phalanx.models import distributions as D
from phalanx.models.mlp import ActionHead

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes `mask_envs:make` importable

import mask_envs  # noqa: E402


def random_mask(shape, gen, heads=None):
    """A random bool mask leaving each row (each head's part of it) at least one True."""
    u = torch.rand(shape, generator=gen)
    parts = []
    for part in (u.split(heads, -1) if heads else [u]):
        one = torch.nn.functional.one_hot(part.argmax(-1), part.shape[-1]).bool()
        parts.append((part < 0.5) | one)
    return torch.cat(parts, -1)


def reference(logits, legal):
    """Brute force: probabilities renormalised over the legal set, row by row, in float64."""
    p = torch.zeros(logits.shape, dtype=torch.float64)
    for idx in range(logits.shape[0]):
        allowed = legal[idx].nonzero().flatten().tolist()
        z = sum(math.exp(float(logits[idx, k])) for k in allowed)
        for k in allowed:
            p[idx, k] = math.exp(float(logits[idx, k])) / z
    return p


def entropy_of(p):
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def test_masked_log_prob_and_entropy_equal_the_renormalised_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 7, generator=gen) * 2
    mask = random_mask((64, 7), gen)
    p = reference(logits, mask)
    masked = D.masked_logits(logits, mask)
    for a in range(7):
        actions = torch.full((64,), a)
        got = D.categorical_log_prob(masked, actions)
        legal = mask[:, a]
        assert torch.allclose(got[legal].double(), p[legal, a].log(), atol=1e-5)
        assert (got[~legal] < -1e8).all()  # a forbidden action has probability 0
    assert torch.allclose(D.categorical_entropy(masked).double(), entropy_of(p), atol=1e-5)
    lp, ent = D.categorical_log_prob_entropy(masked, torch.zeros(64, dtype=torch.long))
    assert torch.allclose(ent.double(), entropy_of(p), atol=1e-5)


def test_masked_sampling_frequencies_match_the_reference_and_never_leave_the_mask():
    gen = torch.Generator().manual_seed(1)
    logits = torch.tensor([[1.5, -0.5, 0.0, 2.0, 0.3, -1.0]])
    mask = torch.tensor([[True, True, False, False, True, True]])
    p = reference(logits, mask)[0]
    draws = 200_000
    samples = D.masked_categorical_sample(logits.expand(draws, 6), mask.expand(draws, 6), gen)
    freq = torch.bincount(samples, minlength=6).double() / draws
    assert freq[~mask[0]].sum() == 0
    tolerance = 5 * (p * (1 - p) / draws).sqrt() + 1e-9
    assert ((freq - p).abs() <= tolerance).all(), (freq, p)
    assert int(D.masked_argmax(logits, mask)) == 0  # the best legal one (3 is better but forbidden)


def test_a_legal_action_that_drew_zero_still_beats_every_forbidden_one():
    # u = 0 (a 2^-24 chance a draw) scores a legal action -inf; the unmasked sampler would then pick a forbidden one.
    logits = torch.zeros(1, 3)
    mask = torch.tensor([[False, True, False]])
    u = torch.tensor([[0.5, 0.0, 0.5]])
    draws = Draws(torch.Generator())
    draws.plan = [Draw("rand", (1, 3), torch.float32, torch.device("cpu"))]
    with draws.replaying([u]):
        picked = D.masked_categorical_sample(D.masked_logits(logits, mask), mask, draws)
    assert picked.tolist() == [1]
    with draws.replaying([u]):
        assert D.categorical_sample(D.masked_logits(logits, mask), draws).tolist() != [1]


def test_forbidden_logits_get_no_gradient():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 5, generator=gen).requires_grad_()
    mask = random_mask((16, 5), gen)
    actions = D.masked_categorical_sample(logits.detach(), mask, gen)
    lp, ent = D.categorical_log_prob_entropy(D.masked_logits(logits, mask), actions)
    (lp.sum() + ent.sum()).backward()
    assert (logits.grad[~mask] == 0).all() and (logits.grad[mask] != 0).any()


def test_head_with_per_slot_counts_and_a_mask_matches_the_reference():
    """Discrete slot_n (slot 1 has 3 of 5 actions) composed with a per-step mask: the legal set is both."""
    gen = torch.Generator().manual_seed(3)
    head = ActionHead(Discrete(5, slot_n=(5, 3)))
    out = torch.randn(32, 2, 5, generator=gen)
    mask = random_mask((32, 2, 5), gen)
    mask[:, 1, 0] = True  # slot 1 keeps an action of its own
    legal = mask & head.valid
    p = reference(out.reshape(-1, 5), legal.reshape(-1, 5)).reshape(32, 2, 5)
    actions = head.sample(out, gen, False, mask)
    assert legal.gather(-1, actions.unsqueeze(-1)).all()
    want_lp = p.gather(-1, actions.unsqueeze(-1)).squeeze(-1).log()
    assert torch.allclose(head.log_prob(out, actions, mask).double(), want_lp, atol=1e-5)
    lp, ent = head.log_prob_entropy(out, actions, mask)
    assert torch.allclose(lp.double(), want_lp, atol=1e-5)
    assert torch.allclose(ent.double(), entropy_of(p), atol=1e-5)
    assert torch.allclose(head.entropy(out, mask).double(), entropy_of(p), atol=1e-5)
    greedy = head.sample(out, None, True, mask)
    assert torch.equal(greedy, torch.where(legal, out, -math.inf).argmax(-1))


def test_multidiscrete_head_masks_each_head_and_weights_gated_entropy_by_the_renormalised_chance():
    nvec, gates = (3, 5, 2), ((1, 2, 1),)  # head 1 matters only where head 2 == 1
    head = ActionHead(MultiDiscrete(nvec, gates=gates))
    gen = torch.Generator().manual_seed(4)
    out = torch.randn(40, 10, generator=gen)
    mask = random_mask((40, 10), gen, heads=nvec)
    parts_out, parts_mask = out.split(nvec, -1), mask.split(nvec, -1)
    ps = [reference(o, m) for o, m in zip(parts_out, parts_mask)]
    actions = head.sample(out, gen, False, mask)
    for k in range(3):
        assert parts_mask[k].gather(-1, actions[:, k:k + 1]).all()
    lps = [p.gather(-1, actions[:, k:k + 1]).squeeze(-1).log() for k, p in enumerate(ps)]
    on = (actions[:, 2] == 1).double()
    assert torch.allclose(head.log_prob(out, actions, mask).double(), lps[0] + lps[1] * on + lps[2], atol=1e-5)
    ents = [entropy_of(p) for p in ps]
    want = ents[0] + ents[1] * ps[2][:, 1] + ents[2]
    assert torch.allclose(head.entropy(out, mask).double(), want, atol=1e-5)
    greedy = head.sample(out, None, True, mask)
    for k in range(3):
        assert torch.equal(greedy[:, k], torch.where(parts_mask[k], parts_out[k], -math.inf).argmax(-1))


def test_multidiscrete_sampling_frequencies_per_head():
    nvec = (3, 2)
    head = ActionHead(MultiDiscrete(nvec))
    gen = torch.Generator().manual_seed(5)
    out = torch.tensor([[0.2, 1.0, -0.4, 0.5, 0.0]])
    mask = torch.tensor([[True, False, True, True, True]])
    draws = 100_000
    actions = head.sample(out.expand(draws, 5), gen, False, mask.expand(draws, 5))
    for k, (o, m) in enumerate(zip(out.split(nvec, -1), mask.split(nvec, -1))):
        p = reference(o, m)[0]
        freq = torch.bincount(actions[:, k], minlength=nvec[k]).double() / draws
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / draws).sqrt() + 1e-9).all(), (k, freq, p)


def logits_before_masks(space, out):
    """The head's logits as it made them before masks existed: padded per head, or the slots' own counts."""
    if isinstance(space, MultiDiscrete):
        return D.pad_multi_logits(out, space.nvec)
    return out if not space.slot_n else out.masked_fill(~space.valid_actions(), D.MASKED_LOGIT)


@pytest.mark.parametrize("space", [Discrete(6), Discrete(6, slot_n=(6, 4, 2)), MultiDiscrete((3, 4), gates=((1, 0, 2),))])
def test_no_mask_and_an_all_true_mask_are_the_unmasked_head_to_the_bit(space):
    head = ActionHead(space)
    gen = torch.Generator().manual_seed(6)
    out = torch.randn(8, 3, head.out_dim, generator=gen)
    everything = torch.ones(8, 3, head.out_dim, dtype=torch.bool)
    logits = logits_before_masks(space, out)
    plain = D.categorical_sample(logits, torch.Generator().manual_seed(9))
    assert torch.equal(head.sample(out, torch.Generator().manual_seed(9), False), plain)
    assert torch.equal(head.sample(out, torch.Generator().manual_seed(9), False, everything), plain)
    assert torch.equal(head.sample(out, None, True), logits.argmax(-1))
    assert torch.equal(head.sample(out, None, True, everything), logits.argmax(-1))
    if isinstance(space, Discrete):
        assert torch.equal(head.log_prob(out, plain), D.categorical_log_prob(logits, plain))
        assert torch.equal(head.entropy(out), D.categorical_entropy(logits))
    for mask in (None, everything):
        assert torch.equal(head.log_prob(out, plain, mask), head.log_prob(out, plain))
        assert torch.equal(head.entropy(out, mask), head.entropy(out))
        pair, want = head.log_prob_entropy(out, plain, mask), head.log_prob_entropy(out, plain)
        assert torch.equal(pair[0], want[0]) and torch.equal(pair[1], want[1])


def test_a_mask_on_continuous_actions_is_refused():
    head = ActionHead(Box.uniform(-1, 1, (2,)))
    with pytest.raises(ValueError, match="Discrete and MultiDiscrete"):
        head.sample(torch.zeros(3, 2), None, True, torch.ones(3, 2, dtype=torch.bool))


@pytest.mark.parametrize("space,heads,emptied", [
    (Discrete(5), None, slice(0, 5)),
    (Discrete(5, slot_n=(5, 3)), None, slice(0, 3)),  # actions 3 and 4 left, which slot 1 does not have
    (MultiDiscrete((3, 2)), (3, 2), slice(3, 5)),  # the second head left nothing
])
def test_random_legal_actions_are_uniform_over_the_mask(space, heads, emptied):
    gen = torch.Generator().manual_seed(7)
    mask = random_mask((1, 2, space.mask_width), gen, heads)
    if heads is None and space.slot_n:
        mask[0, 1, :2] = True
    draws = 40_000
    actions = space.sample(draws, 2, gen, "cpu", mask=mask.expand(draws, 2, space.mask_width))
    legal = mask[0] if heads or not space.slot_n else mask[0] & space.valid_actions()
    for j in range(2):
        for k, part in enumerate(legal[j].split(heads, -1) if heads else [legal[j]]):
            column = actions[:, j, k] if heads else actions[:, j]
            freq = torch.bincount(column, minlength=part.numel()).double() / draws
            want = part.double() / part.sum()
            assert ((freq - want).abs() <= 5 * (want * (1 - want) / draws).sqrt() + 1e-9).all(), (j, k, freq, want)
    assert not space.allows_nothing(mask).any()
    mask[0, 1, emptied] = False
    if isinstance(space, Discrete) and space.slot_n:
        mask[0, 1, 3:] = True
    assert space.allows_nothing(mask).tolist() == [[False, True]]


@pytest.mark.parametrize("space", ["discrete", "multi"])
def test_check_env_passes_a_masked_env_stepping_only_legal_actions(space):
    env = mask_envs.make(num_envs=3, space=space)
    check_env(env, steps=24)  # the env refuses any action its mask forbids


@pytest.mark.parametrize("space,defect,message", [
    ("discrete", "shape", "reset() record.action_mask must have shape [4, 2, 5]; got [4, 2, 6]"),
    ("multi", "dtype", "reset() record.action_mask must be bool (True: allowed) [N, A, sum(nvec)]; got uint8"),
    ("discrete", "empty", "step() record.action_mask allows no action to slot 1 of env 0; a mask must leave every slot"),
    ("multi", "empty", "allows no action to a head of slot 1 of env 0"),
    ("discrete", "refuses", "step() raised ActionError: action 0 refused on actions the last record's action_mask allows"),
    ("box", "", "record.action_mask is set but action_space is Box"),
    ("discrete", "undeclared", "reset() record.action_mask is set but the env does not declare action_masks = True"),
    ("multi", "missing", "reset() record.action_mask is None but the env declares action_masks = True"),
])
def test_check_env_refuses_a_broken_mask_in_one_line(space, defect, message, capsys):
    with pytest.raises(EnvContractError, match="masked_pick"):
        check_env(mask_envs.make(num_envs=4, space=space, defect=defect), steps=24)
    argv = ["check-env", "mask_envs:make", "--space", space] + (["--defect", defect] if defect else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
