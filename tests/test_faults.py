"""Fault injection and bad input: NaN from envs, path safety of league snapshot names, config fuzzing."""

import contextlib
import json
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import phalanx
from phalanx import budget, devices
from phalanx import build as build_module
from phalanx.algo import saved_bytes
from phalanx.budget import run_bytes
from phalanx.buffer import BatchEvaluator
from phalanx.cli import main
from phalanx.config import FIELDS, resolve
from phalanx.envs import make
from phalanx.errors import CheckpointError, NonFiniteEnvError, PhalanxError
from phalanx.models.registry import build_model
from phalanx.trainer import Trainer

SMALL = dict(env="cartpole", num_envs=4, num_steps=16, num_minibatches=2, num_epochs=1, progress=False, tensorboard=False)


def _poison(trainer: Trainer, at_call: int, field: str, value: float) -> None:
    step, calls = trainer.run.env.step, {"n": 0}

    def bad_step(actions):
        rec = step(actions)
        calls["n"] += 1
        if calls["n"] == at_call:
            t = getattr(rec, field).clone()
            t.view(-1)[1] = value
            setattr(rec, field, t)
        return rec

    trainer.run.env.step = bad_step


@pytest.mark.parametrize("field,value", [("obs", float("nan")), ("reward", float("inf")), ("final_obs", float("-inf"))])
def test_nonfinite_env_values_stop_the_run_with_a_snapshot(tmp_path, field, value):
    t = Trainer(resolve(dict(SMALL, run_dir=str(tmp_path / "r"), norm_obs=True)))
    try:
        _poison(t, at_call=16 + 5, field=field, value=value)  # the second update's 6th step
        with pytest.raises(NonFiniteEnvError) as e:
            t.train()
        msg = str(e.value)
        assert "env 'cartpole'" in msg and "rollout step 4 of update 2" in msg and "nonfinite_update_000002" in msg
        assert (tmp_path / "r" / "nonfinite_update_000002" / "batch.safetensors").is_file()
        assert [json.loads(x)["update"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == [1]
    finally:
        t.close()


def test_nonfinite_env_values_can_be_zeroed_and_counted(tmp_path):
    t = Trainer(resolve(dict(SMALL, run_dir=str(tmp_path / "r"), nonfinite_env="zero", norm_obs=True, total_steps=64 * 3)))
    try:
        _poison(t, at_call=20, field="obs", value=float("nan"))
        result = t.train()
        rows = result.history
        assert rows[1]["env_nonfinite"] == 1 and "env_nonfinite" not in rows[0] and "env_nonfinite" not in rows[2]
        assert all(torch.isfinite(p).all() for p in t.run.model.parameters())
        assert torch.isfinite(t.run.norms.obs.mean).all()
    finally:
        t.close()


def test_snapshot_names_cannot_escape_the_run_directory(tmp_path):
    from phalanx.league.league import snapshot_path

    for bad in ("../../etc/passwd", "/abs/path", "a/b", "..", "snapshot_1\x00"):
        with pytest.raises(CheckpointError, match="league snapshot name"):
            snapshot_path(tmp_path, bad)
    assert snapshot_path(tmp_path, "snapshot_000000000128").parent == tmp_path / "league" / "snapshots"


def test_symlinked_checkpoint_directory_is_not_followed_outside(tmp_path):
    run = tmp_path / "r"
    phalanx.train(run_dir=run, total_steps=64, **SMALL)
    outside = tmp_path / "outside"
    outside.mkdir()
    ck = run / "checkpoints"
    for p in ck.iterdir():
        (outside / p.name).mkdir()
    import shutil

    shutil.rmtree(ck)
    ck.symlink_to(outside)
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    with pytest.raises(PhalanxError, match="symlink"):
        phalanx.train(resume=run, total_steps=128)
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before  # nothing written or pruned there
    assert main(["train", "--resume", str(run)]) == 2


# -- config fuzzing --------------------------------------------------------------------------------------
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-5, 300), max_size=4),
)
_KEYS = st.one_of(st.sampled_from(sorted(FIELDS)), st.text(min_size=1, max_size=10))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=st.dictionaries(_KEYS, _VALUES, max_size=3))
def test_random_configs_resolve_or_fail_with_one_line(overrides):
    overrides = {k: v for k, v in overrides.items() if k not in ("run_dir", "device", "torch_threads")}
    try:
        cfg = resolve(dict(SMALL), overrides)
    except PhalanxError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) < 400
        key = next((k for k in overrides if k in msg), None)
        assert key is not None or "unknown config key" in msg or "env" in msg, msg
        return
    for k, v in cfg.to_dict().items():  # a resolved config holds only sane values
        if isinstance(v, float):
            assert math.isfinite(v), k


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["num_envs", "num_steps", "lr", "gamma", "clip_coef", "model", "hidden_sizes", "activation"]),
       value=st.one_of(st.integers(-3, 3), st.floats(-2, 2), st.sampled_from(["", "x", "lstm", "[]", "nan"])))
def test_cli_train_with_random_values_runs_or_exits_2(tmp_path_factory, key, value, capsys):
    run = tmp_path_factory.mktemp("fuzz") / "r"
    argv = ["train", "--env", "cartpole", "--total-steps", "64", "--num-envs", "2", "--num-steps", "32",
            "--num-minibatches", "1", "--progress", "false", "--tensorboard", "false", "--run-dir", str(run),
            f"--{key.replace('_', '-')}", str(value)]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors (e.g. a negative number read as an option)
        code = e.code
    err = capsys.readouterr().err
    if code == 0:
        assert (run / "checkpoints").is_dir()
    else:
        assert code == 2 and err.count("\n") == 1 and err.startswith("phalanx: error:"), err


@pytest.mark.slow
def test_kill_9_storm_then_resume_matches_uninterrupted(tmp_path):
    """A self-play `phalanx train` is SIGKILLed at 12 random moments (checkpoints and league snapshots
    are written every update, so many kills land inside writes); after each kill the run directory is
    consistent, and the run resumed to the end equals the uninterrupted one."""
    import contextlib
    import random
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from phalanx import checkpoint as ckpt
    from phalanx.league import LEAGUE_FILE

    updates = 120  # about 0.2 s each on 2 CPUs (a checkpoint and a snapshot every update): 12 lives do not finish
    args = ["--env", "duel", "--time-limit", "90", "--total-steps", str(64 * updates), "--num-envs", "4",
            "--num-steps", "16", "--num-epochs", "1", "--num-minibatches", "2", "--checkpoint-every", "64",
            "--snapshot-every", "64", "--pool-size", "3", "--hidden-sizes", "32,32", "--seed", "3",
            "--progress", "false", "--tensorboard", "false", "--torch-threads", "1", "--device", "cpu"]
    cmd = [sys.executable, "-m", "phalanx", "train"]
    # The uninterrupted run trains beside the storm: lives are timed from events, not from launch.
    full = subprocess.Popen(cmd + args + ["--run-dir", str(tmp_path / "full")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    run = tmp_path / "killed"
    rng = random.Random(20)
    kills = 0
    for _ in range(60):
        started = bool(ckpt.list_checkpoints(run))
        proc = subprocess.Popen(cmd + (["--resume", str(run)] if started else args + ["--run-dir", str(run)]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Time the kill from the moment a resumed process holds the run lock (it writes its pid there),
        # and a fresh run from its first checkpoint, not from launch: on a loaded machine imports and
        # set-up can outlast a launch-timed kill, and kills that all land before anything is saved
        # leave nothing to resume and test nothing.
        ready_by = time.time() + 120
        while proc.poll() is None and time.time() < ready_by:
            if started:
                with contextlib.suppress(OSError):
                    if (run / ".lock").read_text() == str(proc.pid):
                        break
            elif ckpt.list_checkpoints(run):
                break
            time.sleep(0.02)
        # At most 1 s of training per life: 12 lives (about 60 updates) must not finish the 120 updates (a clean CI
        # run once finished 200 after 19 kills with up to 1.7 s each). 12, not 20: the fault suite stays under 2 minutes.
        time.sleep(rng.uniform(0.0, 1.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(60)
        if ckpt.list_checkpoints(run):  # consistent after every kill: the newest complete checkpoint loads
            _, _, meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(run))
            for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]:
                json.loads(line)  # only the last line may be cut by a kill
            json.loads((run / LEAGUE_FILE).read_text())  # written atomically: never half a file
            names = [o["name"] for o in meta["league"]["opponents"] if o["kind"] == "snapshot"]
            for name in names:  # every snapshot the checkpoint's pool names exists
                assert (run / "league" / "snapshots" / f"{name}.safetensors").is_file(), name
        if kills >= 12 or (proc.returncode == 0):
            break
    print(f"kills: {kills}")
    assert kills >= 12
    done = subprocess.run(cmd + ["--resume", str(run)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert full.wait(600) == 0, full.stderr.read()
    a = load_file(str(ckpt.latest_checkpoint(tmp_path / "full") / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(run) / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == list(range(1, updates + 1))
    full_league = json.loads((tmp_path / "full" / LEAGUE_FILE).read_text())
    assert json.loads((run / LEAGUE_FILE).read_text())["ratings"] == full_league["ratings"]


def test_tensorboard_continues_at_the_right_step_after_a_lost_update(tmp_path):
    """Update 4 reached TensorBoard and metrics.jsonl but its checkpoint was lost (a kill): the resumed
    run replays update 4, and both logs hold every step exactly once, in order."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from phalanx import checkpoint as ckpt

    run = tmp_path / "r"
    cfg = dict(SMALL, tensorboard=True, total_steps=64 * 6, checkpoint_every=64 * 3)
    phalanx.train(run_dir=run, max_updates=4, **cfg)
    shutil.rmtree(ckpt.checkpoint_path(run, 64 * 4))  # as if killed before update 4's checkpoint
    assert ckpt.latest_checkpoint(run).name == f"step_{64 * 3:012d}"
    phalanx.train(resume=run)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [64 * i for i in range(1, 7)]
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tb_steps = [e.step for e in acc.Scalars("losses/loss")]
    assert tb_steps == [64 * i for i in range(1, 7)], tb_steps


def test_checkpoint_of_another_format_version_is_refused(tmp_path):
    from phalanx import checkpoint as ckpt

    run = tmp_path / "r"
    phalanx.train(run_dir=run, total_steps=64, **SMALL)
    meta_path = ckpt.latest_checkpoint(run) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json|format version 99") as e:
        phalanx.train(resume=run, total_steps=128)
    assert str(ckpt.latest_checkpoint(run)) in str(e.value)


def test_corrupt_league_files(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import league_env  # noqa: F401

    from phalanx.league import LEAGUE_FILE

    run = tmp_path / "r"
    cfg = dict(SMALL, env="test_rps", opponents="self_play:1,rock:1", total_steps=64 * 4, snapshot_every=64)
    phalanx.train(run_dir=run, max_updates=2, **cfg)
    (run / LEAGUE_FILE).write_text("{ not json")  # the live file is damaged: the checkpoint's copy is used
    result = phalanx.train(resume=run)
    assert result.metrics["step"] == 64 * 4
    assert json.loads((run / LEAGUE_FILE).read_text())["step"] == 64 * 4
    snap = next((run / "league" / "snapshots").glob("*.safetensors"))
    snap.write_bytes(snap.read_bytes()[:40])  # a truncated snapshot: an error naming the file
    state = json.loads((run / LEAGUE_FILE).read_text())
    assert main(["eval", str(run), "--vs", "snapshot:" + snap.stem, "--episodes", "2"]) == 2
    err = capsys.readouterr().err
    assert snap.name in err and err.count(chr(10)) == 1
    assert state["ratings"]  # nothing lost


def test_an_impossible_num_envs_is_refused_before_the_env_is_built(tmp_path, monkeypatch, capsys):
    """`--num-envs 100000000` once built the env first (14 GB and climbing, no message): the memory check now runs
    on a copy of a few envs, from declared sizes, and the full env is never made."""
    made = []
    real_make = build_module.make

    def counting_make(name, num_envs, **kwargs):
        made.append(num_envs)
        return real_make(name, num_envs=num_envs, **kwargs)

    monkeypatch.setattr(build_module, "make", counting_make)
    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: 8 << 30)
    assert main(["train", "--num-envs", "100000000", "--total-steps", "1e10", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("phalanx: error: the run needs about ") and "but cpu has 8,192 MiB free" in err
    most = int(re.search(r"lower num_envs \(100000000: at most ([\d,]+) fit with num_steps 64\) or num_steps$",
                         err).group(1).replace(",", ""))
    assert max(made) <= build_module.PROBE_ENVS and not (tmp_path / "r").exists()
    # The most that fit: its run fits in the 80% of free memory the check allows, one env more does not.
    cfg = resolve(dict(env="cartpole", total_steps=10**10))
    probe = make("cartpole", num_envs=4)
    model = build_model(cfg, probe)
    need = lambda n: sum(run_bytes(n, cfg.num_steps, probe, probe.reset(seed=1), model).values())  # noqa: E731
    assert need(most) <= 0.8 * (8 << 30) < need(most + 1)


WIDE = dict(SMALL, num_envs=64, num_steps=128, num_minibatches=1, hidden_sizes=[256, 256])


def test_a_minibatch_whose_activations_do_not_fit_runs_in_pieces_and_says_so(tmp_path, monkeypatch, capsys):
    """update_chunks 0 (the default): where the rollout buffers fit but a minibatch's activations do not, the
    minibatch runs in the fewest pieces that fit (the same update, tests/test_multiagent.py) instead of failing;
    the estimate (saved tensors per row, measured on 8 and 16 rows) is what autograd keeps for a whole minibatch."""
    roomy = Trainer(resolve(dict(WIDE, run_dir=str(tmp_path / "a"))))
    try:
        evaluate = BatchEvaluator(roomy.run.model, contextlib.nullcontext, roomy.run.buffer)  # the update's forward (fp32)
        need, rows = budget.minibatch_activations(evaluate, roomy.run.buffer, 1, roomy.run.step_hp, roomy.run.params, None)
        assert roomy.run.step_hp.update_chunks == 1 and rows == 64 * 128
        b, shape = roomy.run.buffer, (128, 64, 1)
        zeros = torch.zeros(shape)
        batch = b.ppo_batch(zeros, zeros, zeros, torch.ones(shape, dtype=torch.bool), None)
        whole = saved_bytes(evaluate, batch.index(torch.arange(rows)), roomy.run.step_hp, roomy.run.params)
        assert abs(need / 2 - whole) <= 0.05 * whole, (need, whole)
    finally:
        roomy.close()
    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: int(need / 3 / 0.8) + 1)
    t = Trainer(resolve(dict(WIDE, progress=True, run_dir=str(tmp_path / "b"))))
    try:
        assert t.run.step_hp.update_chunks == 3
        assert "each minibatch runs in 3 pieces (update_chunks), the same update" in capsys.readouterr().err
        t.collect()
        before = [p.detach().clone() for p in t.run.model.parameters()]
        t.update()
        assert any(not torch.equal(a, p) for a, p in zip(before, t.run.model.parameters()))
    finally:
        t.close()
    # On the CPU a piece holds at most CPU_PIECE_BYTES, memory or not; an explicit count is kept.
    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: 8 << 30)
    monkeypatch.setattr(budget, "CPU_PIECE_BYTES", need // 2 + 1)
    for chunks, expected, name in ((0, 2, "c"), (5, 5, "d")):
        t = Trainer(resolve(dict(WIDE, update_chunks=chunks, run_dir=str(tmp_path / name))))
        assert t.run.step_hp.update_chunks == expected
        t.close()


def test_activations_that_fit_not_even_a_row_at_a_time_are_refused(tmp_path, monkeypatch):
    free = iter([8 << 30, 4096])  # the buffers fit; then almost nothing is left

    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: next(free, 4096))
    with pytest.raises(PhalanxError, match=r"^a minibatch of 8,192 rows needs about [\d,]+ MiB of activations and cpu has "
                                           r"0 MiB free after the rollout buffers: not even one row at a time fits; lower "
                                           r"num_envs or num_steps, or raise num_minibatches$"):
        Trainer(resolve(dict(WIDE, run_dir=str(tmp_path / "r"))))


@pytest.mark.parametrize("over", [dict(env="cartpole"), dict(env="duel", model="lstm"), dict(env="bucket_brigade")])
def test_the_memory_estimate_from_a_few_envs_matches_the_built_run(tmp_path, over):
    """What `run_bytes` says from the copy of 4 envs is what the run of 64 holds: the rollout buffers exactly, the
    env's step state and records exactly (their per-env tensors scale; the rest stays)."""
    cfg = resolve(dict(SMALL, **over, num_envs=64, run_dir=str(tmp_path / "r")))
    t = Trainer(cfg)
    try:
        probe = make(cfg.env, num_envs=4, seed=1, **cfg.env_options)
        need = run_bytes(cfg.num_envs, cfg.num_steps, probe, probe.reset(seed=1), t.run.model)
        held = sum(b.numel() * b.element_size() for b in t.run.buffer.values())
        assert need["rollout buffer"] == held
        full = list(t.run.env.step_state().values()) + list(t.run.env.reset(seed=1).tensors().values())
        assert need["envs"] == sum(x.numel() * x.element_size() for x in full)
    finally:
        t.close()
