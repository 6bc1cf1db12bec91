"""Readouts that do not mislead: what a return is (an agent's or a team's), no `nan` before the first episode,
progress that never passes its total, a closing line with the run's own time and speed, the checkpoint `eval`
played, and `compare` writing beside the runs it compares."""

from __future__ import annotations

import json
import re

from phalanx.cli import main

TINY = ["--num-epochs", "1", "--num-minibatches", "1", "--tensorboard", "false", "--torch-threads", "1"]


def _train(tmp_path, capsys, *args: str) -> tuple[list[str], list[str]]:
    assert main(["train", *TINY, *args]) == 0
    out = capsys.readouterr()
    return out.out.splitlines(), out.err.splitlines()


def test_progress_counts_whole_updates_and_never_passes_its_total(tmp_path, capsys):
    """total_steps 200 with 64-step updates ran to step 256 while the progress said `256/200`."""
    out, err = _train(tmp_path, capsys, "--num-envs", "4", "--num-steps", "16", "--total-steps", "200",
                      "--run-dir", str(tmp_path / "r"))
    steps = [tuple(int(x.replace(",", "")) for x in m.groups()) for line in err
             if (m := re.match(r"step\s+([\d,]+)/([\d,]+)", line))]
    assert steps and all(done <= total == 256 for done, total in steps) and steps[-1] == (256, 256)
    assert "total_steps 200 rounds up to whole updates: 4 of 64 steps, 256 steps" in err


def test_no_nan_return_before_the_first_episode_ends_and_the_closing_line_agrees(tmp_path, capsys):
    """Two steps an update: no cartpole episode ends in the first ones, where the progress said `return nan`.
    The closing line gives the return the progress showed last, the run's time and its average speed (it gave the
    last update's return and steps/s)."""
    out, err = _train(tmp_path, capsys, "--num-envs", "2", "--num-steps", "2", "--total-steps", "120",
                      "--run-dir", str(tmp_path / "r"))
    progress = [line for line in err if line.startswith("step ")]
    assert progress[0].endswith("return (no episode ended yet)")
    assert not any(re.search(r"\bnan\b", line) for line in err + out)
    last = float(re.search(r"return (-?[\d.]+)$", progress[-1]).group(1))
    closing = next(line for line in out if line.startswith("training return"))
    assert closing.startswith(f"training return: {last:.2f} (mean of the last updates' episodes")
    trained = next(line for line in out if line.startswith("trained:"))
    assert re.fullmatch(r"trained: +to step 120 in [\d.]+ s \([\d,]+ steps/s on average\)", trained), trained


def test_a_multi_agent_run_says_its_returns_are_per_agent_and_eval_says_which_is_the_teams(tmp_path, capsys):
    run = tmp_path / "r"
    out, err = _train(tmp_path, capsys, "--env", "bucket_brigade", "--num-envs", "4", "--num-steps", "64",
                      "--total-steps", "512", "--run-dir", str(run))
    assert all("return per agent" in line for line in err if line.startswith("step "))
    assert any(line.startswith("training return per agent: ") for line in out)
    assert main(["eval", str(run), "--episodes", "2"]) == 0
    text = capsys.readouterr().out
    assert "checkpoint of step 512 in " + str(run) in text.splitlines()[0]
    assert "mean team return" in text and "mean return per agent" in text and "mean_agent_return" not in text


def test_eval_names_the_checkpoint_it_played(tmp_path, capsys):
    run = tmp_path / "r"
    _train(tmp_path, capsys, "--num-envs", "4", "--num-steps", "16", "--total-steps", "128", "--checkpoint-every", "64",
           "--run-dir", str(run), "--progress", "false")
    assert main(["eval", str(run), "--episodes", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint_step"] == 128
    assert main(["eval", str(run), "--episodes", "2", "--vs", "random"]) == 0
    assert f"checkpoint of step 128 in {run}" in capsys.readouterr().out.splitlines()[0]


def test_compare_writes_beside_the_runs_not_into_the_current_directory(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "seeds"
    for seed in (1, 2):
        _train(tmp_path, capsys, "--num-envs", "4", "--num-steps", "16", "--total-steps", "128", "--seed", str(seed),
               "--eval-episodes", "2", "--run-dir", str(folder / f"s{seed}"), "--progress", "false")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["compare", str(folder)]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (folder / "compare").iterdir()) == ["compare.json", "compare.md", "curves.png"]
    assert main(["compare", str(folder / "s1"), str(folder / "s2"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["markdown"] == str(folder / "compare" / "compare.md")
    assert list(elsewhere.iterdir()) == []


def test_a_value_clip_that_holds_the_critic_back_is_said_once_and_a_free_critic_is_not(tmp_path, capsys):
    """LunarLander at the RL Zoo's settings with the value loss clipped learned to hover (95.7 sampled against 252.0
    unclipped) and nothing said why; `value_clip_fraction` was 0.5-0.78 all run. A clip window far below the
    returns' moves clips nearly every sample: the run says so once, with the keys that free the critic. Without the
    clip (the default) there is nothing to say."""
    args = ["--num-envs", "4", "--num-steps", "16", "--total-steps", str(30 * 64), "--num-epochs", "4",
            "--num-minibatches", "2"]
    _, err = _train(tmp_path, capsys, *args, "--clip-vloss", "true", "--vf-clip-coef", "1e-6", "--run-dir", str(tmp_path / "held"))
    hints = [line for line in err if line.startswith("hint: the value loss clip")]
    assert len(hints) == 1 and "--clip-vloss false, or --norm-value true" in hints[0], err
    share = int(re.search(r"held back (\d+)% of", hints[0]).group(1))
    assert share > 50
    _, err = _train(tmp_path, capsys, *args, "--run-dir", str(tmp_path / "free"))
    assert not any(line.startswith("hint:") for line in err)


def test_the_value_clip_hint_waits_out_a_fresh_critics_first_updates():
    """Healthy runs clip many samples while the critic is new (Hopper at CleanRL's settings: 0.40-0.74 over its
    first 10 updates, then under 0.25): no hint there; one where the share stays above half."""
    from phalanx.logs import value_clip_hint

    hopper = [0.59, 0.42, 0.59, 0.74, 0.65, 0.56, 0.54, 0.55, 0.62, 0.62, 0.40, 0.24, 0.11, 0.07] + [0.0] * 10
    rows = [{"value_clip_fraction": v} for v in hopper]
    assert all(value_clip_hint(rows[:n], 0.2, False) is None for n in range(len(rows) + 1))
    held = [{"value_clip_fraction": 0.6}] * 20
    assert value_clip_hint(held[:19], 0.2, False) is None
    hint = value_clip_hint(held, 0.2, True)
    assert hint is not None and "60%" in hint and "window of 0.2" in hint and "--norm-value" not in hint


def test_a_gradient_clip_that_freezes_the_policy_is_said_once_and_its_remedy_frees_it(tmp_path, capsys):
    """simple_spread through the pz: adapter at the schema's defaults (issue 51): the value loss, in units of a return
    of -25, gave a gradient norm of 25 against max_grad_norm 0.5, so every update was shrunk 50-fold and the policy
    barely moved (approx KL 1e-6 to 1e-8) while nothing said so. CartPole on batches of 64 steps does the same
    (grad norm about 25, approx KL about 5e-5): the run says so once; with the remedy it names (--norm-value true:
    grad norm about 0.5, approx KL 2e-4 to 9e-4) there is nothing to say."""
    args = ["--num-envs", "4", "--num-steps", "16", "--total-steps", str(50 * 64), "--num-epochs", "2",
            "--num-minibatches", "2"]
    _, err = _train(tmp_path, capsys, *args, "--run-dir", str(tmp_path / "frozen"))
    hints = [line for line in err if line.startswith("hint: the gradient clip")]
    assert len(hints) == 1 and "--norm-value true" in hints[0] and "approx_kl" in hints[0], err
    _, err = _train(tmp_path, capsys, *args, "--norm-value", "true", "--run-dir", str(tmp_path / "normalised"))
    assert not any(line.startswith("hint: the gradient clip") for line in err), err


def test_the_gradient_clip_hint_needs_a_shrunk_step_and_a_still_policy():
    from phalanx.logs import grad_clip_hint

    frozen = [{"grad_norm": 25.0, "approx_kl": 1e-6}] * 40
    assert grad_clip_hint(frozen[:39], 0.5, False, 16) is None  # warm-up
    hint = grad_clip_hint(frozen, 0.5, False, 16)
    assert hint is not None and "50x" in hint and "--norm-value true" in hint
    assert "--max-grad-norm" in grad_clip_hint(frozen, 0.5, True, 16)
    # One minibatch step an update measures its KL before the step (0): it cannot say whether the policy moved.
    assert grad_clip_hint(frozen, 0.5, False, 1) is None
    moving = [{"grad_norm": 25.0, "approx_kl": 5e-3}] * 40  # clipped hard, yet the policy moves: no hint
    annealed = [{"grad_norm": 0.2, "approx_kl": 1e-8}] * 40  # a still policy at the end of an annealed run
    assert grad_clip_hint(moving, 0.5, False, 16) is None and grad_clip_hint(annealed, 0.5, False, 16) is None
