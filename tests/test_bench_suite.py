"""`phalanx bench suite` / `phalanx bench profile`: rows, files, JSON, the update-cycle split, errors."""

import itertools
import json
import types

import pytest

from phalanx import profile
from phalanx.cli import main
from phalanx_bench import harness, reports, runners
from phalanx_bench import sb3 as sb3_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--num-envs", "8", "--steps", "16", "--seconds", "0.05"]


def _check_profile(p: dict) -> None:
    assert p["note"] is None, p["note"]
    assert p["cycles"] >= 1 and p["cycle_seconds"] > 0
    parts = p["parts"]
    assert set(parts) == {k for k, _ in reports.PROFILE_PARTS}
    assert all(v >= 0 for v in parts.values()), parts
    assert parts["env_step"] > 0 and parts["policy_forward"] > 0 and parts["update"] > 0 and parts["gae"] > 0
    # The parts lie inside the cycle and cover most of it; the host read and logging count in the cycle only, and on
    # a loaded machine one preemption there is a tenth of a tiny cycle (0.065 s of parts in a 0.074 s cycle, seen once).
    assert 0.75 * p["cycle_seconds"] <= sum(parts.values()) <= 1.01 * p["cycle_seconds"]
    assert 0.0 <= p["model_fraction"] <= 1.0
    assert p["model_fraction"] == pytest.approx((parts["policy_forward"] + parts["update"]) / p["cycle_seconds"])


def test_suite_json_rows_files_and_profile(tmp_path, capsys):
    assert main(["bench", "suite", "--workloads", "cartpole,duel", *TINY, "--out", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1  # one JSON object on one line, nothing else on stdout
    result = json.loads(captured.out)
    assert "| workload |" in captured.err  # the table went to stderr

    assert [(r["workload"], r["num_envs"]) for r in result["rows"]] == [("cartpole", 8), ("duel", 8)]
    for row in result["rows"]:
        assert row["note"] is None
        assert row["env"]["sps"] > 0 and row["train"]["sps"] > 0
        assert row["peak_memory"]["method"] in ("rss_peak_growth", "ru_maxrss_growth", "cuda_max_memory_allocated")
        assert isinstance(row["peak_memory"]["bytes"], int) and row["peak_memory"]["bytes"] >= 0
    assert result["workloads"]["duel"]["num_agents"] == 2
    assert result["workloads"]["cartpole"]["num_steps"] == 16
    assert {"cpu_model", "torch", "torch_threads", "device"} <= set(result["machine"])

    # The profile ran at the largest --num-envs for both workloads; duel's league fills the opponent slots.
    assert [(p["workload"], p["num_envs"]) for p in result["profile"]] == [("cartpole", 8), ("duel", 8)]
    for p in result["profile"]:
        _check_profile(p)
    assert result["profile"][1]["parts"]["opponents"] > 0
    assert result["profile"][0]["parts"]["opponents"] == 0

    md = (tmp_path / "bench.md").read_text()
    assert result["files"]["markdown"] == str(tmp_path / "bench.md")
    assert result["machine"]["cpu_model"] in md and result["machine"]["torch"] in md
    for row in result["rows"]:
        line = next(x for x in md.splitlines() if x.startswith(f"| {row['workload']} |"))
        assert f"| {reports.fmt_sps(row['env']['sps'])} | {reports.fmt_sps(row['train']['sps'])} |" in line
    assert "## Update-cycle profile" in md and f"{result['profile'][0]['model_fraction']:.0%}" in md
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_profile_reads_the_trainers_own_clock_and_switches_it_off(capsys, monkeypatch):
    seen = []
    real = runners._timed_cycles

    def spy(trainer, seconds):
        assert trainer.run.timer.enabled  # the trainer's phases are timed, nothing of it is replaced
        seen.append(trainer)
        return real(trainer, seconds)

    monkeypatch.setattr(runners, "_timed_cycles", spy)
    assert main(["bench", "profile", "--workloads", "cartpole", *TINY, "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["target"] == "profile" and len(result["profile"]) == 1
    _check_profile(result["profile"][0])
    assert "model compute (policy forward + update)" in captured.err
    (trainer,) = seen
    assert not trainer.run.timer.enabled


def test_phase_timer_counts_nested_phases_once_and_costs_nothing_when_off(monkeypatch):
    ticks = itertools.count()  # every perf_counter call is one second later
    monkeypatch.setattr(profile, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    clock = profile.PhaseTimer("cpu", enabled=True)
    with pytest.raises(RuntimeError):
        with clock.phase("collect"):
            with clock.phase("env_step"), clock.phase("env_step"):
                pass
            raise RuntimeError("timed even so")
    # collect spans ticks 0 to 3 around the inner phase; env_step ticks 1 to 2, its nested repeat untimed.
    assert clock.seconds["collect"] == 3.0 and clock.seconds["env_step"] == 1.0
    clock.enabled = False
    before = next(ticks)
    with clock.phase("update"):
        pass
    assert next(ticks) == before + 1 and clock.seconds["update"] == 0.0


def test_unknown_workload_is_one_line_naming_the_allowed(capsys):
    assert main(["bench", "suite", "--workloads", "cartpole,nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown workload 'nosuch'" in err
    from phalanx.envs import registered

    for name in registered():
        assert name in err
    assert main(["bench", "profile", "--workloads", "gym:CartPole-v1"]) == 2
    assert main(["bench", "cartpole", "--workloads", "cartpole"]) == 2


def test_rows_that_cannot_run_are_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    # Above pixel_goal's cap: not built at all.
    assert main(["bench", "suite", "--workloads", "pixel_goal", "--num-envs", "2048", "--steps", "4", "--seconds", "0.05",
                 "--no-profile", "--out", str(tmp_path), "--json"]) == 0
    row, = json.loads(capsys.readouterr().out)["rows"]
    assert row["note"].startswith("skipped: above pixel_goal's cap") and row["train"] is None and row["env"] is None
    # A rollout buffer that would not fit in the free memory: the Trainer's ConfigError becomes the note.
    from phalanx import devices

    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: 1024)
    assert main(["bench", "suite", "--workloads", "cartpole", *TINY, "--out", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"][0]["note"].startswith("skipped: the run needs")
    assert result["profile"][0]["note"].startswith("skipped: the run needs")
    assert "skipped: the run needs" in (tmp_path / "bench.md").read_text()


def test_alternating_measure_takes_turns_and_pairs_rounds():
    """Contestants run turn by turn, each round one window of each, so the paired median ratio holds
    even when the machine's speed drifts: here both slow down together after the third round."""
    order: list[str] = []
    clock = {"t": 0.0}

    def fake_step(name: str, cost: float):
        def step():
            order.append(name)
            clock["t"] += cost * (1 if len(order) < 6 else 3)  # the machine slows down 3x from the sixth call on
        return step

    real = harness.time.perf_counter
    harness.time.perf_counter = lambda: clock["t"]
    try:
        got = harness.measure_alternating({"a": (fake_step("a", 0.25), 100), "b": (fake_step("b", 0.5), 100)},
                                          seconds=2.0, device=harness.torch.device("cpu"), warmup=0)
    finally:
        harness.time.perf_counter = real
    assert order[:4] == ["a", "b", "a", "b"]
    assert got["a"]["windows"] == got["b"]["windows"] >= 2
    assert harness.median_ratio(got["a"], got["b"]) == pytest.approx(2.0)
    assert got["a"]["sps"] == pytest.approx(400.0)


def test_suite_measures_a_plugin_env(tmp_path, capsys):
    assert main(["bench", "suite", "--workloads", "tests.contract_envs:good", *TINY, "--no-profile", "--out", str(tmp_path),
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(r["workload"], r["num_envs"]) for r in result["rows"]] == [("tests.contract_envs:good", 8)]
    assert main(["bench", "suite", "--workloads", "nosuch.mod:make"]) == 2
    assert "or package.module:factory" in capsys.readouterr().err


def test_sb3_comparison_uses_sb3s_own_settings():
    """The like-for-like row runs Phalanx at Stable-Baselines3 PPO's defaults, read from SB3 itself."""
    sb3 = pytest.importorskip("stable_baselines3")
    import inspect

    d = {k: p.default for k, p in inspect.signature(sb3.PPO.__init__).parameters.items()}
    s = sb3_bench.SB3_SETTINGS
    assert s["num_steps"] == d["n_steps"] and s["num_epochs"] == d["n_epochs"]
    assert s["num_envs"] * s["num_steps"] // s["num_minibatches"] == d["batch_size"]
    assert (s["lr"], s["gamma"], s["gae_lambda"], s["clip_coef"]) == (d["learning_rate"], d["gamma"], d["gae_lambda"], d["clip_range"])
    assert (s["ent_coef"], s["vf_coef"], s["max_grad_norm"], s["norm_adv"]) == (d["ent_coef"], d["vf_coef"], d["max_grad_norm"],
                                                                              d["normalize_advantage"])
    cfg = sb3_bench.sb3_settings_config("unused")
    assert cfg.batch_size == 16384 and cfg.batch_size // cfg.num_minibatches == 64 and cfg.hidden_sizes == [64, 64]


def test_one_line_keeps_the_cause_when_the_first_line_only_introduces_it():
    # Inductor's failures read "SubprocException: An exception occurred in a subprocess:" and then a
    # traceback: the GPU --compile row's note said only that, and the cause was lost with the process.
    from phalanx.errors import one_line

    e = RuntimeError("SubprocException: An exception occurred in a subprocess:\n\nTraceback (most recent call last):\n"
                     "  File \"x.py\", line 1, in f\nAssertionError: the real reason\n")
    assert one_line(e) == "RuntimeError: SubprocException: An exception occurred in a subprocess: ... AssertionError: the real reason"
    assert one_line(ValueError("bad value\nmore detail")) == "ValueError: bad value"
    assert one_line(KeyError()) == "KeyError: "
