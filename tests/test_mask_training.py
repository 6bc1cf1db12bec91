"""Action masks through training and play (issue 50): the rollout samples under each step's mask and stores it,
the update evaluates every action on the mask it was sampled under (so the PPO ratio starts at 1), and trained
policies, teammates and evaluation never play a forbidden action (mask_envs' env refuses one)."""

import sys
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.buffer import fields
from phalanx.envs import Discrete, make
from phalanx.evaluate import evaluate_policy
from phalanx.models.mlp import MLPActorCritic

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes `mask_envs:make` importable

import mask_envs  # noqa: E402

SMALL = dict(num_envs=4, num_steps=16, num_epochs=2, num_minibatches=2, progress=False, tensorboard=False)


def test_act_value_and_evaluate_value_agree_under_the_same_mask():
    gen = torch.Generator().manual_seed(0)
    model = MLPActorCritic(5, Discrete(5), num_agents=2)
    obs = torch.randn(6, 2, 5, generator=gen)
    mask = torch.rand(6, 2, 5, generator=gen) < 0.4
    mask[..., 3] = True
    with torch.no_grad():
        action, logp, _ = model.act_value(obs, gen, False, None, mask)
        assert bool(mask.gather(-1, action.unsqueeze(-1)).all())
        again, ent, _ = model.evaluate_value(obs, action, obs, mask)
        unmasked, _, _ = model.evaluate_value(obs, action, obs)
    torch.testing.assert_close(again, logp)
    assert bool((again >= unmasked).all()) and not torch.equal(again, unmasked)  # renormalised over fewer actions
    assert bool((ent <= torch.log(mask.sum(-1).float()) + 1e-6).all())


def test_buffer_keeps_a_mask_only_where_the_env_gives_masks():
    masked = mask_envs.make(num_envs=2)
    model = MLPActorCritic(5, Discrete(5), num_agents=2)
    by_name = {f.name: f for f in fields(masked, model)}
    assert by_name["action_mask"].shape == (5,) and by_name["action_mask"].sample
    assert "action_mask" not in {f.name for f in fields(make("cartpole", num_envs=2), MLPActorCritic(4, Discrete(2)))}


@pytest.mark.parametrize("space, model", [("discrete", "mlp"), ("multi", "mlp"), ("discrete", "lstm")])
def test_a_masked_env_trains_and_plays_no_forbidden_action(tmp_path, space, model):
    # The env raises ActionError on a forbidden action: a rollout or evaluation that played one would fail here.
    result = phalanx.train(env="mask_envs:make", env_options={"space": space}, model=model, total_steps=4 * 16 * 2 * 4,
                           seed=1, run_dir=tmp_path / "r", **SMALL)
    for greedy in (True, False):
        out = evaluate_policy(result.policy, "mask_envs:make", env_options={"space": space}, episodes=8, greedy=greedy)
        assert out["episodes"] >= 8
    random = evaluate_policy(None, "mask_envs:make", env_options={"space": space}, episodes=8, greedy=False)
    assert random["episodes"] >= 8


def test_masked_training_learns_the_rewarded_legal_action(tmp_path):
    # Paid 1 for the highest allowed action: the allowed set changes every step, so only a policy that reads the
    # mask (its observation) and samples within it scores well. Random legal play scores under 3 of 8 (two slots, 4 steps).
    result = phalanx.train(env="mask_envs:make", total_steps=20_000, seed=2, run_dir=tmp_path / "r", lr=3e-3,
                           **{**SMALL, "num_envs": 16, "num_steps": 32, "num_epochs": 4})
    trained = evaluate_policy(result.policy, "mask_envs:make", episodes=32, seed=3)
    random = evaluate_policy(None, "mask_envs:make", episodes=64, seed=3, greedy=False)
    assert random["mean_return"] < 3.2, random
    assert trained["mean_return"] > 7.0, (trained, random)


@pytest.mark.parametrize("model", ["mlp", "lstm"])
def test_the_export_of_a_masked_run_takes_the_mask_and_plays_in_lockstep(tmp_path, model):
    pytest.importorskip("onnxruntime")
    from phalanx.deployed import ACTION_MASK, DeployedPolicy
    from phalanx.export import export_onnx, lockstep, read_contract

    run = tmp_path / "r"
    phalanx.train(env="mask_envs:make", model=model, total_steps=4 * 16 * 2, seed=1, run_dir=run, **SMALL)
    policy = phalanx.load(run)
    assert policy.action_masks
    path = export_onnx(policy, tmp_path / "p.onnx")
    inputs = {i["name"]: i for i in read_contract(path)["inputs"]}
    assert inputs[ACTION_MASK]["dtype"] == "bool" and inputs[ACTION_MASK]["shape"] == ["batch", 2, 5]
    out = lockstep(run, path, episodes=8, num_envs=4)  # the env refuses a forbidden action
    assert out["actions_identical"] and out["episodes"] >= 8, out
    deployed = DeployedPolicy(policy)
    mask = torch.zeros(3, 2, 5, dtype=torch.bool)
    mask[..., 2] = True
    named = deployed.named(*(mask if s.name == ACTION_MASK else x for s, x in zip(deployed.inputs, deployed.example_inputs(3))))
    assert bool((named["action"] == 2).all()) and bool((named["logits"][..., [0, 1, 3, 4]] <= -1e8).all())


def test_the_export_of_an_unmasked_run_takes_no_mask(tmp_path):
    from phalanx.deployed import ACTION_MASK, DeployedPolicy

    result = phalanx.train(env="cartpole", total_steps=4 * 16, seed=1, run_dir=tmp_path / "r", **SMALL)
    assert ACTION_MASK not in [s.name for s in DeployedPolicy(result.policy).inputs]


def test_resume_of_a_masked_run_is_bit_identical(tmp_path):
    """The checkpoint keeps the record's action mask: a resumed run acted on a fresh reset's and played a forbidden
    action (seen failing as a strict xfail before the fix)."""
    from safetensors.torch import load_file

    from phalanx import checkpoint as ckpt

    cfg = dict(env="mask_envs:make", total_steps=64 * 4, seed=3, checkpoint_every=64, **SMALL)
    phalanx.train(run_dir=tmp_path / "full", **cfg)
    phalanx.train(run_dir=tmp_path / "part", max_updates=2, **cfg)
    phalanx.train(resume=tmp_path / "part")  # before the fix: ActionError, a forbidden action after the resume
    a, b = (load_file(str(ckpt.latest_checkpoint(tmp_path / r) / "model.safetensors")) for r in ("full", "part"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("defect,message", [
    ("empty_later", "returned an action mask that allows no action to a slot: first at rollout step 4 of update 1 (env "
                    "copy 0, slot 1)"),
    ("missing_later", "declares action_masks but its step returned action_mask=None at rollout step 4 of update 1"),
])
def test_a_mask_that_breaks_the_contract_mid_run_stops_training_in_one_line(defect, message, tmp_path, capsys):
    """An env declaring action_masks whose step later returns no mask, or a row that allows nothing to a slot that
    acts, trained to exit 0 (the update scored those actions under the buffer's all-forbidden zeros). Now the run
    stops before any update trains on it, in one line naming the step and the slot, exit 2 (issue 63; failed on main)."""
    from phalanx.cli import main

    run = tmp_path / "run"
    assert main(["train", "--env", "mask_envs:make", "--defect", defect, "--num-envs", "4", "--num-steps", "8",
                 "--total-steps", "64", "--run-dir", str(run), "--progress", "false", "--tensorboard", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())  # nothing trained, nothing kept
