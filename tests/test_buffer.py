"""The rollout buffer (phalanx.buffer): its fields per model, critic and frame stack, the row writes, the bootstrap
filled in after the loop, and the samples laid out for minibatches, every sample field as the others."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from phalanx import buffer as buffer_module
from phalanx.algo import PPOBatch
from phalanx.buffer import Field, RolloutBuffer, Step, buffer_bytes, buffer_specs
from phalanx.config import resolve
from phalanx.envs import make
from phalanx.models.registry import build_model
from phalanx.trainer import Trainer

SMALL = dict(num_envs=3, num_steps=5, num_minibatches=1, hidden_sizes=[8], lstm_hidden=8, cnn_channels=[4, 8, 8], cnn_dense=8)


def _buffer(**kw) -> tuple[RolloutBuffer, object]:
    cfg = resolve({**SMALL, **kw})
    env = make(cfg.env, num_envs=cfg.num_envs, seed=0, **cfg.env_options)
    return RolloutBuffer(cfg.num_steps, env, build_model(cfg, env)), env


@pytest.mark.parametrize("kw, present, absent", [
    (dict(env="cartpole"), {"obs": (5, 3, 1, 4)}, {"resets", "env_active", "states", "frames"}),
    (dict(env="cartpole", model="lstm"), {"obs": (5, 3, 1, 4), "resets": (5, 3, 1), "env_active": (5, 3, 1)},
     {"states", "frames"}),
    (dict(env="bucket_brigade", critic="mappo"), {"states": None}, {"resets", "frames"}),
    (dict(env="pixel_goal", model="cnn"), {"frames": None, "stack_restarts": (5, 3, 1)}, {"obs", "resets"}),
])
def test_fields_follow_the_model_the_critic_and_the_frame_stack(kw, present, absent):
    buffer, env = _buffer(**kw)
    T, N, A = 5, 3, env.num_agents
    for name, shape in present.items():
        assert name in buffer and (shape is None or tuple(buffer[name].shape) == shape), name
    assert not absent & set(buffer)
    for name in ("actions", "logprobs", "values", "next_values", "rewards", "terminated", "truncated", "active",
                 "trial_end"):
        assert tuple(buffer[name].shape[:3]) == (T, N, A), name
    if "states" in buffer:  # one global state per env, not per slot
        assert buffer["states"].shape[:2] == (T, N) and buffer["states"].dim() == 3
    if "frames" in buffer:  # each frame once: the older frames of the first stack lead
        assert buffer["frames"].shape[0] == T + env.frame_stack - 1 and buffer["frames"].dtype == torch.uint8
    # What the memory check counts is what the buffer holds.
    cfg = resolve({**SMALL, **kw})
    assert buffer_bytes(buffer_specs(cfg.num_steps, env, build_model(cfg, env))) == sum(
        t.numel() * t.element_size() for t in buffer.values())
    env.close()


def _step(env, g: torch.Generator) -> Step:
    """A step of `env` with random actions, log-probs and values: what the rollout hands the buffer."""
    rec = env.reset(seed=0)
    N, A = env.num_envs, env.num_agents
    step = Step(acted_on=rec, obs=rec.obs.reshape(N, A, -1).float(), action=torch.randint(0, 2, (N, A), generator=g),
                logprob=torch.randn(N, A, generator=g), value=torch.randn(N, A, generator=g),
                acting=rec.active, resets=torch.zeros(N, A, dtype=torch.bool))
    return step


def _outcome(env, step: Step) -> Step:
    rec = env.step(step.action)
    step.outcome, step.done, step.reward = rec, rec.terminated | rec.truncated, rec.reward * 3
    step.bootstrap = torch.full_like(step.value, 5.0)
    return step


def test_a_row_written_by_index_tensor_equals_one_written_by_int():
    a, env = _buffer(env="cartpole")
    b, _ = _buffer(env="cartpole")
    step = _step(env, torch.Generator().manual_seed(0))
    for buffer, row in ((a, 2), (b, torch.tensor([2]))):
        buffer.write(row, step)  # before the envs step
    _outcome(env, step)
    for buffer, row in ((a, 2), (b, torch.tensor([2]))):
        buffer.write(row, step)  # after
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(a["values"][2], step.value) and torch.equal(a["rewards"][2], step.reward)
    assert torch.equal(a["next_values"][2], step.bootstrap) and not a["values"][1].any()
    env.close()


def test_a_field_declared_in_the_buffer_alone_is_written_by_the_rollout(tmp_path, monkeypatch):
    """A new per-step field is one `Field` (buffer.py): the rollout, which names no field, writes its row every step,
    before the envs step or after (`outcome`)."""
    declared = buffer_module.fields

    def more(env, model):
        return [*declared(env, model), Field("doubled_values", torch.float32, lambda s: 2 * s.value),
                Field("rewards_again", torch.float32, lambda s: s.reward, outcome=True)]

    monkeypatch.setattr(buffer_module, "fields", more)
    trainer = Trainer(resolve(dict(env="cartpole", num_envs=4, num_steps=6, progress=False, tensorboard=False,
                                   run_dir=str(tmp_path / "r"))))
    try:
        trainer.collect()
        b = trainer.run.buffer
        assert torch.equal(b["doubled_values"], 2 * b["values"]) and torch.equal(b["rewards_again"], b["rewards"])
        assert b["rewards"].abs().sum() > 0
    finally:
        trainer.close()


def test_bootstrap_takes_the_next_steps_value_where_not_truncated():
    buffer, env = _buffer(env="cartpole")
    values = torch.arange(15.0).reshape(5, 3, 1)
    buffer["values"].copy_(values)
    buffer["next_values"].fill_(-7.0)  # as the steps wrote V(final_obs) where truncated
    buffer["truncated"][1, 2] = True
    buffer["truncated"][4, 0] = True
    after = torch.full((3, 1), 100.0)
    buffer.bootstrap(after)
    nv = buffer["next_values"]
    assert nv[1, 2] == -7.0 and nv[4, 0] == -7.0  # truncated: its own V(final_obs) stays
    assert nv[1, 0] == values[2, 0] and nv[3, 1] == values[4, 1]
    assert nv[4, 1] == 100.0 and nv[4, 2] == 100.0  # after the last step: the value of what follows the rollout
    env.close()


@pytest.mark.parametrize("model", ["mlp", "lstm"])
def test_every_sample_field_is_laid_out_as_the_others(model):
    """Rows (step, env) for feed-forward models, [A, T] segments per env for memory models: each field declared
    as a sample reaches the batch under its name in the same layout as the advantages."""
    buffer, env = _buffer(env="cartpole", model=model)
    g = torch.Generator().manual_seed(0)
    for t in buffer.values():
        t.copy_(torch.randint(0, 2, t.shape, generator=g).to(t.dtype) if t.dtype == torch.bool else
                torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else
                torch.randint(0, 2, t.shape, generator=g))
    adv = torch.randn(5, 3, 1, generator=g)
    batch = buffer.ppo_batch(adv, adv, adv, None, None)
    layout = (lambda x: x.permute(1, 2, 0, *range(3, x.dim()))) if model == "lstm" else (lambda x: x.flatten(0, 1))
    samples = [f.name for f in buffer.fields if f.sample]
    assert {"actions", "logprobs"} <= set(samples) and (model == "mlp") == ("resets" not in samples)
    for name in samples:
        assert torch.equal(getattr(batch, name), layout(buffer[name])), name
    assert torch.equal(batch.advantages, layout(adv)) and batch.mask is None
    env.close()


def test_index_gathers_every_field_of_a_batch():
    """A field added to PPOBatch is gathered by `index` as the others (what a new per-step field needs)."""
    n = 6
    fields = {f.name: torch.arange(n * 2.0).reshape(n, 2) + i for i, f in enumerate(dataclasses.fields(PPOBatch))
              if f.name != "frames"}
    batch = PPOBatch(**fields)
    idx = torch.tensor([4, 1])
    part = batch.index(idx)
    for name, t in fields.items():
        assert torch.equal(getattr(part, name), t[idx]), name
    assert part.frames is None and set(batch.tensors()) == set(fields)
