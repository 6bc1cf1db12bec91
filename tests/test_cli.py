"""The command line: errors are one line with exit status 2; commands produce their files."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from phalanx.cli import main


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--env", "nosuchenv"], "unknown env 'nosuchenv'; allowed: "),
        (["train", "--num-envs", "0"], "'num_envs' must be > 0"),
        (["train", "--num-steps", "-3"], "'num_steps' must be > 0"),
        (["train", "--lr", "fast"], "'lr' must be float"),
        (["train", "--total-steps", "1.5"], "'total_steps' must be int"),
        (["train", "--activation", "sigmoid"], "'activation' must be one of tanh, relu, gelu, silu"),
        (["train", "--no-such-key", "3"], "unknown option '--no-such-key'"),
        (["train", "--max-steps", "abc"], "env option 'max_steps' of 'cartpole' must be int"),
        (["train", "--config", "/nonexistent.yaml"], "config file '/nonexistent.yaml' does not exist"),
        (["train", "--device", "cuda:7"], "'device'"),
        (["train", "--resume", "/nonexistent-run"], "not a run directory"),
        (["eval", "/nonexistent-run"], "not a run directory"),
        # Out of range (each was accepted and trained once): discounts and mixes in [0, 1], sizes and limits
        # positive, at least one batch of steps, no absurd step counts.
        (["train", "--gamma", "1.5"], "config key 'gamma' must be in [0.0, 1.0], got 1.5"),
        (["train", "--gae-lambda", "7"], "config key 'gae_lambda' must be in [0.0, 1.0], got 7.0"),
        (["train", "--team-reward", "5"], "config key 'team_reward' must be in [0.0, 1.0], got 5.0"),
        (["train", "--max-steps", "-5"], "env option 'max_steps' of 'cartpole' must be >= 1; got -5"),
        (["train", "--env", "duel", "--stocks", "0"], "env option 'stocks' of 'duel' must be >= 1; got 0"),
        (["train", "--total-steps", "1e99"], "config key 'total_steps' must be <= 1e+15"),
        (["train", "--total-steps", "10"], "config key 'total_steps' must be at least one batch, num_envs * num_steps = "
                                           "2,048; got 10"),
        (["train", "--print-config", "--gamma", "2"], "config key 'gamma' must be in [0.0, 1.0], got 2.0"),
        (["check-env", "cartpole", "--steps", "-5"], "check-env --steps must be >= 1, got -5"),
        (["check-env", "cartpole", "--num-envs", "0"], "check-env --num-envs must be >= 1, got 0"),
        (["eval", "/nonexistent-run", "--episodes", "0"], "eval --episodes must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, needle, capsys, tmp_path):
    code = main(argv + ["--run-dir", str(tmp_path / "r")] if argv[0] == "train" and "--resume" not in argv else argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert needle in err
    assert "Traceback" not in err


def test_bad_config_files(tmp_path, capsys):
    bad_yaml = tmp_path / "b.yaml"
    bad_yaml.write_text("lr: [unclosed\n")
    assert main(["train", "--config", str(bad_yaml)]) == 2
    assert f"config file '{bad_yaml}' is not valid" in capsys.readouterr().err
    unknown = tmp_path / "u.toml"
    unknown.write_text("learning_rate = 3\n")
    assert main(["train", "--config", str(unknown)]) == 2
    assert "unknown config key 'learning_rate'" in capsys.readouterr().err


def test_subprocess_error_has_no_traceback():
    out = subprocess.run([sys.executable, "-m", "phalanx", "train", "--env", "nope"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert "Traceback" not in out.stderr


def test_help_lists_every_key(capsys):
    from phalanx.config import describe_keys

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for key, _, default, _ in describe_keys():
        if key != "env_options":
            assert "--" + key.replace("_", "-") in text


def test_envs_lists_spaces(capsys):
    assert main(["envs", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cartpole"]["action"] == "Discrete(2)"
    assert "Box(shape=[1]" in rows["pendulum"]["action"]
    assert "max_steps" in rows["cartpole"]["options"]


def test_train_says_the_tensorboard_command_only_where_it_wrote_events(tmp_path, capsys):
    """`--tensorboard false` printed the TensorBoard command for a run with no events (issue 63; failed on main)."""
    for flag, said in (("false", False), ("true", True)):
        run = tmp_path / flag
        assert main(["train", "--env", "cartpole", "--total-steps", "256", "--num-envs", "8", "--num-steps", "16",
                     "--progress", "false", "--tensorboard", flag, "--run-dir", str(run)]) == 0
        out = capsys.readouterr().out
        assert ("tensorboard --logdir" in out) == said, out
        assert (run / "tb").is_dir() == said


def test_train_eval_plot_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--env", "cartpole", "--total-steps", "512", "--num-envs", "8", "--num-steps", "16",
                 "--progress", "false", "--run-dir", str(run), "--max-steps", "200"])
    assert code == 0
    out = capsys.readouterr().out
    assert f"run directory:  {run}" in out and "learning_curve.png" in out
    assert json.loads((run / "config.json").read_text())["env_options"] == {"max_steps": 200}
    assert main(["eval", str(run), "--episodes", "5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {"mean_return", "median_return", "std_return", "mean_length", "episodes"} <= set(res)
    assert res["episodes"] == 5 and res["mean_length"] <= 200
    assert main(["eval", str(run), "--episodes", "3", "--sample"]) == 0
    assert "sampled" in capsys.readouterr().out
    png = run / "plots" / "learning_curve.png"
    png.unlink()
    assert main(["plot", str(run)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Resuming a finished run with a larger budget continues it.
    assert main(["train", "--resume", str(run), "--total-steps", "768", "--progress", "false"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 768


def test_second_training_on_same_run_dir_is_refused(tmp_path):
    from phalanx.errors import PhalanxError
    from phalanx.runs import RunLock

    (tmp_path / "r").mkdir()
    held = RunLock(tmp_path / "r")
    held.acquire()
    try:
        with pytest.raises(PhalanxError, match="in use by another training"):
            RunLock(tmp_path / "r").acquire()
    finally:
        held.release()


def test_bench_prints_a_table(capsys):
    assert main(["bench", "cartpole", "--num-envs", "8", "--seconds", "0.2", "--no-ref"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.strip().startswith("8 ")]
    assert row, out
    assert main(["bench", "cartpole", "--num-envs", "0"]) == 2


def test_eval_vs_table_for_a_team(tmp_path, capsys):
    run = tmp_path / "bb"
    assert main(["train", "--env", "bucket_brigade", "--scenario", "greedy_neighbor", "--total-steps", "256", "--num-envs", "8",
                 "--num-steps", "16", "--teammates", "hero,free_rider", "--progress", "false", "--tensorboard", "false",
                 "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "6", "--vs", "hero,random", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert set(table) == {"learned", "hero", "random"}
    for row in table.values():
        assert row["episodes"] == 6
        assert {"mean_return", "mean_agent_return", "mean_houses_saved"} <= set(row)
        assert row["mean_agent_return"] == pytest.approx(row["mean_return"] / 4)
    assert table["hero"]["mean_houses_saved"] > table["random"]["mean_houses_saved"]
    assert main(["eval", str(run), "--episodes", "4", "--vs", "hero"]) == 0
    out = capsys.readouterr().out
    assert "houses_saved" in out and out.count("\n") >= 4
    assert main(["eval", str(run), "--episodes", "4", "--vs", "nosuch"]) == 2
    assert "unknown opponent/team 'nosuch'" in capsys.readouterr().err
    # Env options override the run's for this evaluation only: a short time limit cuts every episode.
    assert main(["eval", str(run), "--episodes", "6", "--max-nights", "3", "--vs", "hero", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert short["learned"]["mean_length"] <= 3 and short["hero"]["mean_length"] <= 3
    assert table["hero"]["mean_length"] > 3
    assert main(["eval", str(run), "--episodes", "4", "--nosuch-option", "1"]) == 2
    assert "unknown option '--nosuch-option' (not an eval flag" in capsys.readouterr().err


def test_print_config_names_the_layer_of_every_key(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("gamma: 0.97\nnum_steps: 16\n")
    assert main(["train", "--env", "cartpole", "--config", str(cfg_file), "--lr", "1e-3", "--num-steps", "8", "--max-steps", "100",
                 "--print-config"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        key, rest = line.split("=", 1)
        value, source = rest.rsplit("  # ", 1)
        rows[key.strip()] = (json.loads(value), source)
    assert rows["lr"] == (0.001, "command line")
    assert rows["num_steps"] == (8, "command line")  # the command line over the file
    assert rows["gamma"] == (0.97, "file")
    assert rows["num_envs"] == (32, "env 'cartpole' defaults")
    assert rows["seed"] == (1, "schema")
    assert rows["env_options"] == ({"max_steps": 100}, "command line")
    assert list(tmp_path.iterdir()) == [cfg_file]  # nothing was created
    assert main(["train", "--env", "bucket_brigade", "--critic", "mappo", "--print-config"]) == 0
    assert re.search(r"^norm_value +=  ?true  # ", capsys.readouterr().out, re.M)


def test_help_after_env_shows_that_envs_defaults_and_every_choice(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--env", "cartpole", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default with --env cartpole in brackets" in text
    assert "parallel environments [32]" in text and "Adam learning rate [0.002]" in text
    assert "(one of mlp, lstm, transformer, strategy, cnn, role_attention, board)" in text
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "parallel environments [8]" in " ".join(capsys.readouterr().out.split())


def test_eval_shows_greedy_and_sampled_play_side_by_side(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--env", "cartpole", "--total-steps", "256", "--num-envs", "8", "--num-steps", "16",
                 "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["greedy"] is True and {"mean_return", "mean_length"} <= set(res["sampled_play"])
    assert main(["eval", str(run), "--episodes", "4", "--vs", "random"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[2:]] == ["learned", "learned,", "random"] and "learned, sampled" in lines[3]


def test_plot_takes_several_runs(tmp_path, capsys):
    runs = []
    for seed in (1, 2):
        run = tmp_path / f"seed{seed}"
        assert main(["train", "--env", "cartpole", "--seed", str(seed), "--total-steps", "512", "--num-envs", "8", "--num-steps",
                     "16", "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)]) == 0
        runs.append(str(run))
    out = tmp_path / "both.png"
    capsys.readouterr()
    assert main(["plot", *runs, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", runs[0], str(tmp_path / "nope")]) == 2


@pytest.mark.skipif(sys.platform != "linux", reason="the background plot forks on Linux only")
def test_closing_plot_in_a_terminal_is_drawn_in_the_background(tmp_path):
    """`phalanx train` in a terminal returns before the learning curve is drawn (a second of a short run); the
    file appears whole, and the child writes nothing to the terminal."""
    import pty

    run = tmp_path / "run"
    pid, fd = pty.fork()
    if pid == 0:  # the child's stdout is a terminal, as a user's is
        os.execv(sys.executable, [sys.executable, "-m", "phalanx", "train", "--env", "cartpole", "--total-steps", "256",
                                  "--num-envs", "8", "--num-steps", "16", "--progress", "false", "--tensorboard", "false",
                                  "--run-dir", str(run)])
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the terminal closed: every writer is gone
            break
        if not chunk:
            break
        out += chunk
    assert os.waitpid(pid, 0)[1] == 0
    png = run / "plots" / "learning_curve.png"
    assert f"learning curve: {png} (drawn in the background)" in out.decode()
    deadline = time.monotonic() + 60
    while not png.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in png.parent.iterdir()] == ["learning_curve.png"]  # no temporary file left


def test_resume_applies_the_same_rules_to_config_files_as_to_flags(tmp_path, capsys):
    """`--resume RUN --config f.yaml` with a changed lr is refused as `--lr` is (the file was silently ignored),
    and a shorter total_steps is refused in one line (it did nothing, said nothing and rewrote config.json)."""
    run = tmp_path / "r"
    assert main(["train", "--num-envs", "4", "--num-steps", "16", "--total-steps", "128", "--progress", "false",
                 "--tensorboard", "false", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    saved = (run / "config.json").read_text()
    changed = tmp_path / "f.yaml"
    changed.write_text("lr: 0.001\n")
    same = tmp_path / "same.yaml"
    same.write_text("num_envs: 4\ntotal_steps: 192\n")
    for argv, needle in ((["--config", str(changed)], "config key 'lr' cannot change on resume (run has 0.002, got 0.001)"),
                         (["--lr", "0.001"], "config key 'lr' cannot change on resume"),
                         (["--total-steps", "64"], "config key 'total_steps' cannot shrink on resume (run has 128, got 64)")):
        assert main(["train", "--resume", str(run), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
        assert (run / "config.json").read_text() == saved
    assert main(["train", "--resume", str(run), "--config", str(same), "--progress", "false"]) == 0
    assert json.loads((run / "config.json").read_text())["total_steps"] == 192


def test_resume_types_env_options_against_the_runs_own_env(tmp_path, capsys):
    """`--resume RUN --scenario hard` on a bucket_brigade run was checked against cartpole's options (the schema's
    default env) and refused as unknown; now the run's own env names them, and a change is refused as a change."""
    run = tmp_path / "r"
    assert main(["train", "--env", "bucket_brigade", "--scenario", "hard", "--num-envs", "2", "--num-steps", "32",
                 "--total-steps", "64", "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--scenario", "easy"]) == 2
    assert "config key 'env_options' cannot change on resume" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--scenario", "hard", "--total-steps", "128", "--progress", "false"]) == 0
    assert json.loads((run / "config.json").read_text())["total_steps"] == 128
