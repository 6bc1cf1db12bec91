"""Trainer, run directory, checkpoints, exact resume and the Python API."""

import hashlib
import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import phalanx
import phalanx.zoo.cartpole
from phalanx import checkpoint as ckpt
from phalanx.config import resolve
from phalanx.errors import CheckpointError, ConfigError, NonFiniteLossError, StorageError
from phalanx.evaluate import evaluate_policy
from phalanx.trainer import Trainer

SMALL = dict(num_envs=8, num_steps=16, num_epochs=2, num_minibatches=2, progress=False, tensorboard=False)


def params_of(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.latest_checkpoint(run_dir) / "model.safetensors"))


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def test_cartpole_learns_far_above_random(tmp_path):
    result = phalanx.train(env="cartpole", total_steps=60_000, seed=3, run_dir=tmp_path / "r", progress=False, tensorboard=False)
    trained = evaluate_policy(result.policy, "cartpole", episodes=16, seed=5)
    random = evaluate_policy(None, "cartpole", episodes=64, seed=5, greedy=False)
    assert random["mean_return"] < 40
    assert trained["mean_return"] > 150, trained


def test_run_directory_contents(tmp_path):
    run = tmp_path / "r"
    result = phalanx.train(env="cartpole", total_steps=8 * 16 * 3, run_dir=run, **{**SMALL, "tensorboard": True})
    assert result.run_dir == run
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["num_envs"] == 8 and cfg["env"] == "cartpole"
    man = json.loads((run / "manifest.json").read_text())
    assert {"torch", "device", "seed", "git_revision", "phalanx"} <= set(man)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "explained_variance", "lr", "sps", "grad_norm"):
        assert all(key in r for r in rows), key
    assert list((run / "tb").glob("events.out.tfevents.*"))
    final = ckpt.latest_checkpoint(run)
    assert final.name == f"step_{3 * 128:012d}"
    assert {p.name for p in final.iterdir()} == {"model.safetensors", "state.safetensors", "meta.json"}


def test_keeps_last_k_checkpoints(tmp_path):
    run = tmp_path / "r"
    phalanx.train(env="cartpole", total_steps=128 * 5, checkpoint_every=128, keep_checkpoints=2, run_dir=run, **SMALL)
    names = [p.name for p in ckpt.list_checkpoints(run)]
    assert names == [f"step_{4 * 128:012d}", f"step_{5 * 128:012d}"]


@pytest.mark.parametrize(
    "env,extra",
    [
        ("cartpole", {}),
        ("pendulum", {"norm_obs": True, "norm_reward": True, "norm_value": True, "target_kl": 0.5}),
    ],
)
def test_resume_is_bit_identical(tmp_path, env, extra):
    cfg = dict(env=env, total_steps=128 * 6, seed=7, checkpoint_every=128, **SMALL, **extra)
    phalanx.train(run_dir=tmp_path / "full", **cfg)
    phalanx.train(run_dir=tmp_path / "part", max_updates=3, **cfg)
    assert ckpt.latest_checkpoint(tmp_path / "part").name == f"step_{3 * 128:012d}"
    phalanx.train(resume=tmp_path / "part")
    a, b = params_of(tmp_path / "full"), params_of(tmp_path / "part")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_resume_refuses_changed_hyperparameters(tmp_path):
    phalanx.train(env="cartpole", total_steps=128, run_dir=tmp_path / "r", **SMALL)
    with pytest.raises(ConfigError, match="'lr' cannot change on resume"):
        phalanx.train(resume=tmp_path / "r", lr=0.5)


def test_new_run_refuses_existing_run_dir(tmp_path):
    phalanx.train(env="cartpole", total_steps=128, run_dir=tmp_path / "r", **SMALL)
    with pytest.raises(ConfigError, match="already holds a run"):
        phalanx.train(env="cartpole", total_steps=128, run_dir=tmp_path / "r", **SMALL)


def _write_then_die(run_dir: str) -> None:
    # Child process: start a checkpoint write and get SIGKILLed halfway through the first file.
    import phalanx.checkpoint as c

    def dying_save(tensors, path):
        with open(path, "wb") as f:
            f.write(b"\x00" * 100)
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    c.save_file = dying_save
    c.save_checkpoint(Path(run_dir), 999, {"w": torch.ones(3)}, {"s": torch.ones(1)}, {}, keep=3)


def test_checkpoint_survives_kill_during_write(tmp_path):
    run = tmp_path / "r"
    good = ckpt.save_checkpoint(run, 10, {"w": torch.arange(3.0)}, {"s": torch.zeros(1)}, {"a": 1}, keep=3)
    proc = mp.get_context("fork").Process(target=_write_then_die, args=(str(run),))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    assert list((run / "checkpoints").glob(".tmp-*")), "the killed writer should leave only a temp dir"
    assert ckpt.latest_checkpoint(run) == good
    model, _, meta = ckpt.load_checkpoint(good)
    assert torch.equal(model["w"], torch.arange(3.0)) and meta["a"] == 1
    ckpt.save_checkpoint(run, 20, {"w": torch.ones(3)}, {"s": torch.zeros(1)}, {}, keep=3)
    assert not list((run / "checkpoints").glob(".tmp-*")), "stale temp dirs of dead writers are cleaned up"


# safetensors reports a full disk as its own error wrapping the OSError's text (seen on a 3 MB tmpfs).
@pytest.mark.parametrize("fault", [OSError(28, "No space left on device"),
                                   SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")])
def test_full_disk_keeps_previous_checkpoint(tmp_path, monkeypatch, fault):
    run = tmp_path / "r"
    good = ckpt.save_checkpoint(run, 10, {"w": torch.arange(3.0)}, {"s": torch.zeros(1)}, {}, keep=3)

    def enospc(tensors, path):
        open(path, "wb").write(b"partial")
        raise fault

    monkeypatch.setattr(ckpt, "save_file", enospc)
    with pytest.raises(StorageError, match=r"could not write checkpoint .*step_000000000020': No space left on device"
                                           r"( \(disk full\))?; previous checkpoints are intact$"):
        ckpt.save_checkpoint(run, 20, {"w": torch.ones(3)}, {"s": torch.zeros(1)}, {}, keep=3)
    assert ckpt.list_checkpoints(run) == [good]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def _resumable_run(tmp_path) -> Path:
    run = tmp_path / "r"
    phalanx.train(env="cartpole", total_steps=256, checkpoint_every=128, run_dir=run, **SMALL)
    return run


def test_truncated_checkpoint_is_refused_and_nothing_changes(tmp_path):
    run = _resumable_run(tmp_path)
    f = ckpt.latest_checkpoint(run) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:50])
    before = tree_digest(run)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        phalanx.train(resume=run)
    assert tree_digest(run) == before


def test_bit_flipped_checkpoint_is_refused(tmp_path):
    run = _resumable_run(tmp_path)
    f = ckpt.latest_checkpoint(run) / "state.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="state.safetensors.*corrupt"):
        phalanx.train(resume=run)


def test_checkpoint_of_other_env_or_shape_is_refused(tmp_path):
    run = _resumable_run(tmp_path)
    other = tmp_path / "pend"
    phalanx.train(env="pendulum", total_steps=128, run_dir=other, **SMALL)
    with pytest.raises(CheckpointError, match="for env 'pendulum', not 'cartpole'"):
        phalanx.load(run, checkpoint=ckpt.latest_checkpoint(other))
    wide = tmp_path / "wide"
    phalanx.train(env="cartpole", total_steps=128, run_dir=wide, hidden_sizes=[32], **SMALL)
    with pytest.raises(CheckpointError, match="shape|lacks parameter"):
        phalanx.load(run, checkpoint=ckpt.latest_checkpoint(wide))


def test_pickle_payload_is_never_executed(tmp_path):
    import pickle

    run = _resumable_run(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    target = ckpt.latest_checkpoint(run)
    for name in ("model.safetensors", "state.safetensors", "meta.json"):
        (target / name).write_bytes(pickle.dumps(Payload()))
        with pytest.raises(CheckpointError):
            phalanx.load(run)
        assert not marker.exists()


class NaNRewardEnv(phalanx.zoo.cartpole.CartPoleEnv):
    """CartPole whose rewards turn NaN after a number of steps: a broken user env."""

    def __init__(self, *a, nan_after: int = 40, **kw):
        super().__init__(*a, **kw)
        self.nan_after, self.t = nan_after, 0

    def step(self, actions):
        rec = super().step(actions)
        self.t += 1
        if self.t > self.nan_after:
            rec.reward = torch.full_like(rec.reward, float("nan"))
        return rec


def test_nonfinite_env_rewards_stop_with_snapshot(tmp_path):
    from phalanx.envs import EnvSpec, register
    from phalanx.errors import NonFiniteEnvError

    register(EnvSpec("test_nan_cartpole", NaNRewardEnv, "cartpole with NaN rewards after 40 steps"))
    run = tmp_path / "r"
    with pytest.raises(NonFiniteEnvError, match="env 'test_nan_cartpole' returned") as info:
        phalanx.train(env="test_nan_cartpole", total_steps=128 * 6, checkpoint_every=128, run_dir=run, **SMALL)
    # Updates 1-2 (steps 0..31 per env) are clean; update 3 sees NaN rewards.
    assert ckpt.latest_checkpoint(run).name == f"step_{2 * 128:012d}"
    snap = next(run.glob("nonfinite_update_*"))
    assert str(snap) in str(info.value)
    batch = load_file(str(snap / "batch.safetensors"))
    assert torch.isnan(batch["returns"]).any()
    assert json.loads((snap / "config.json").read_text())["env"] == "test_nan_cartpole"
    phalanx.load(run)  # the last good checkpoint still loads


def test_nonfinite_loss_stops_with_snapshot(tmp_path):
    from phalanx.config import resolve
    from phalanx.trainer import Trainer

    run = tmp_path / "r"
    t = Trainer(resolve(dict(env="cartpole", total_steps=128 * 6, checkpoint_every=128, run_dir=str(run), **SMALL)))
    calls = {"n": 0}

    def poison(module, inputs, output):  # the critic turns NaN in the third update's forward passes
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] > 2 * SMALL["num_minibatches"] * SMALL.get("num_epochs", 4):
                return output * float("nan")
        return output

    t.run.model.critic.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteLossError, match="non-finite") as info:
            t.train()
    finally:
        t.close()
    assert ckpt.latest_checkpoint(run).name == f"step_{2 * 128:012d}"
    snap = next(run.glob("nonfinite_update_*"))
    assert snap.name == "nonfinite_update_000003" and str(snap) in str(info.value)
    ckpt.load_checkpoint(ckpt.latest_checkpoint(run))  # the last good checkpoint is intact


def test_python_api_load_and_act(tmp_path):
    # On the CPU: the loaded policy (CPU) must act bit for bit as the trained one.
    result = phalanx.train(env="pendulum", total_steps=256, run_dir=tmp_path / "r", norm_obs=True, device="cpu", **SMALL)
    policy = phalanx.load(result.run_dir)
    obs = torch.randn(5, 1, 3)
    greedy = policy.act(obs)
    assert greedy.shape == (5, 1, 1) and (greedy.abs() <= 2).all()
    assert torch.equal(greedy, policy.act(obs))
    assert torch.equal(greedy, result.policy.act(obs))
    g = torch.Generator().manual_seed(0)
    sampled = policy.act(obs, greedy=False, generator=g)
    assert not torch.equal(sampled, greedy)
    # Eval uses the saved observation statistics.
    assert policy.obs_rms is not None and not torch.equal(policy.obs_rms.mean, torch.zeros(3, dtype=torch.float64))


def test_config_file_and_overrides_merge(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("env: cartpole\nnum_envs: 4\nlr: 0.01\nnum_steps: 16\n")
    result = phalanx.train(cfg_file, total_steps=64, run_dir=tmp_path / "r", lr=0.02, progress=False, tensorboard=False)
    saved = json.loads((result.run_dir / "config.json").read_text())
    assert saved["num_envs"] == 4 and saved["lr"] == 0.02 and saved["num_steps"] == 16
    toml = tmp_path / "c.toml"
    toml.write_text('env = "pendulum"\nnum_envs = 2\nhidden_sizes = [16, 16]\n')
    from phalanx.config import load_file, resolve

    cfg = resolve(load_file(toml))
    assert cfg.env == "pendulum" and cfg.hidden_sizes == [16, 16] and cfg.num_envs == 2


def test_kill_9_then_resume_matches_uninterrupted(tmp_path):
    """A real `phalanx train` process is SIGKILLed mid-run; `--resume` reaches the same parameters."""
    import subprocess
    import sys
    import time

    args = ["--env", "cartpole", "--total-steps", str(128 * 12), "--num-envs", "8", "--num-steps", "16",
            "--num-epochs", "2", "--num-minibatches", "2", "--checkpoint-every", "128", "--seed", "11",
            "--progress", "false", "--tensorboard", "false", "--torch-threads", "1"]
    cmd = [sys.executable, "-m", "phalanx", "train"]
    subprocess.run(cmd + args + ["--run-dir", str(tmp_path / "full")], check=True, capture_output=True, timeout=300)
    proc = subprocess.Popen(cmd + args + ["--run-dir", str(tmp_path / "killed")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(ckpt.list_checkpoints(tmp_path / "killed")) < 2:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    done = ckpt.list_checkpoints(tmp_path / "killed")
    assert done and int(done[-1].name.split("_")[1]) < 128 * 12, "the kill should land mid-run"
    subprocess.run(cmd + ["--resume", str(tmp_path / "killed")], check=True, capture_output=True, timeout=300)
    a, b = params_of(tmp_path / "full"), params_of(tmp_path / "killed")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["update"] for x in lines] == list(range(1, 13))


def test_trains_on_a_gymnasium_env_through_the_adapter(tmp_path):
    result = phalanx.train(env="gym:CartPole-v1", total_steps=512, run_dir=tmp_path / "r", **{**SMALL, "num_envs": 4})
    assert result.metrics["step"] == 512 and result.metrics["episodes"] > 0
    ev = evaluate_policy(phalanx.load(result.run_dir), "gym:CartPole-v1", episodes=3, seed=1)
    assert ev["episodes"] == 3 and ev["mean_length"] >= 8


@pytest.mark.parametrize("model", ["mlp", "lstm"])
def test_quiet_records_are_what_they_claim_and_skipping_their_tests_changes_nothing(tmp_path, monkeypatch, model):
    """The gym adapter marks a step where no episode ended `quiet` (StepRecord.quiet), and the rollout then
    skips its end-of-episode tests and writes: its flags must be all false and every slot active, and a
    run that ignores the hint (and `finite`) must fill the same buffers and count the same episodes."""
    from dataclasses import replace

    from phalanx.config import resolve
    from phalanx.envs.adapters.gym import GymVecEnv
    from phalanx.trainer import Trainer

    step = GymVecEnv.step
    seen = {"quiet": 0, "loud": 0}

    def checked(self, actions):
        rec = step(self, actions)
        if rec.quiet:
            assert not (rec.terminated.any() or rec.truncated.any() or rec.trial_end.any()) and rec.active.all()
        seen["quiet" if rec.quiet else "loud"] += 1
        return rec

    def ignored(self, actions):
        return replace(step(self, actions), quiet=False, finite=False)

    runs = {}
    for name, fn in (("hint", checked), ("no_hint", ignored)):
        monkeypatch.setattr(GymVecEnv, "step", fn)
        t = Trainer(resolve(dict(env="gym:CartPole-v1", model=model, total_steps=2048, seed=5, run_dir=str(tmp_path / name),
                                 **{**SMALL, "num_envs": 4, "num_steps": 64})))
        try:
            stats = [{k: v.clone() for k, v in t.collect().items()} for _ in range(3)]
            runs[name] = (stats, {k: v.clone() for k, v in t.run.buffer.items()})
        finally:
            t.close()
    assert seen["quiet"] > seen["loud"] > 0  # both kinds met, episodes ended
    (stats_a, buf_a), (stats_b, buf_b) = runs["hint"], runs["no_hint"]
    assert sum(float(s["episodes"]) for s in stats_a) > 0
    for a, b in zip(stats_a, stats_b):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (a, b)
    assert all(torch.equal(buf_a[k], buf_b[k]) for k in buf_a)


@pytest.mark.parametrize("model", ["mlp", "lstm"])
def test_bf16_autocast_trains_with_float32_buffers_and_losses(tmp_path, model):
    from phalanx.config import resolve
    from phalanx.trainer import Trainer

    runs_ = {}
    for precision in ("fp32", "bf16"):
        t = Trainer(resolve(dict(env="cartpole", total_steps=256, model=model, precision=precision,
                                 run_dir=str(tmp_path / precision), **SMALL)))
        try:
            before = [p.detach().clone() for p in t.run.model.parameters()]
            result = t.train()
            assert t.run.buffer["logprobs"].dtype == t.run.buffer["values"].dtype == torch.float32
            assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in t.run.model.parameters())
            assert any(not torch.equal(a, b) for a, b in zip(before, t.run.model.parameters()))
            runs_[precision] = result.history[0]["loss"]
        finally:
            t.close()
    assert runs_["fp32"] != runs_["bf16"]  # autocast really ran the forwards in bfloat16


def test_three_runs_launched_together_without_a_run_dir_all_train(tmp_path):
    """Three seeds started in the same second with the default run directory each get their own (a time
    stamp alone named all three alike, and two of three were refused)."""
    import subprocess
    import sys

    args = ["--env", "cartpole", "--total-steps", "256", "--num-envs", "8", "--num-steps", "16", "--progress", "false",
            "--tensorboard", "false", "--torch-threads", "1"]
    procs = [subprocess.Popen([sys.executable, "-m", "phalanx", "train", *args, "--seed", str(s)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for s in (1, 2, 3)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    made = sorted((tmp_path / "runs").iterdir())
    assert len(made) == 3 and all(ckpt.list_checkpoints(r) for r in made)
    assert sorted(json.loads((r / "config.json").read_text())["seed"] for r in made) == [1, 2, 3]


def test_the_trainer_holds_its_run_and_a_few_counters(tmp_path):
    """The trainer holds the run `build_run` made (its parts read as `trainer.run.model`), not a copy of each part:
    a dozen attributes (issue 64: it had 37)."""
    t = Trainer(resolve(dict(env="cartpole", num_envs=2, num_steps=4, progress=False, tensorboard=False,
                             run_dir=str(tmp_path / "r"))))
    try:
        assert len(vars(t)) <= 15, sorted(vars(t))
        assert not {"model", "env", "buffer", "rollout", "optimizer", "cfg"} & set(vars(t))
        t.run.optimizer.set_lr(0.25)  # exact in float32, the device tensor's dtype
        assert t.run.optimizer.lr == 0.25 and float(t.run.optimizer.param_groups[0]["lr"]) == 0.25
    finally:
        t.close()
