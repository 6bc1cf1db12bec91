"""The rollout and update never read device tensors back to the host per step."""

import inspect
import re

from phalanx import build, graphs
from phalanx.algo import gae, normalize, ppo
from phalanx.buffer import BatchEvaluator, RolloutBuffer
from phalanx.config import resolve
from phalanx.episodes import EpisodeCounters
from phalanx.models import distributions, mlp
from phalanx.rollout import Rollout
from phalanx.trainer import Trainer
from phalanx.zoo import cartpole, pendulum

HOST_READS = re.compile(r"\.item\(\)|\.cpu\(\)|\.numpy\(\)|\.tolist\(\)|(?<![.\w])(float|int|bool)\(")


def _code(obj) -> str:
    return "\n".join(line for line in inspect.getsource(obj).splitlines() if not line.strip().startswith("#"))


def test_rollout_and_update_have_no_host_reads():
    for fn in (Rollout.collect, Rollout.step, Rollout._checked, Rollout.value, Rollout.obs_in, normalize.model_input, EpisodeCounters,
               Trainer.update, BatchEvaluator.__call__, BatchEvaluator.sequence, RolloutBuffer, gae.compute_gae, ppo.ppo_losses,
               cartpole.ClassicEnv.step, pendulum.PendulumEnv._transition, distributions,
               mlp.MLPActorCritic.act, mlp.MLPActorCritic.evaluate, mlp.MLPActorCritic.value, mlp.ActionHead.sample,
               mlp.ActionHead.log_prob, mlp.ActionHead.entropy, mlp.ActionHead.to_env):
        assert not HOST_READS.search(_code(fn)), fn


def test_update_reads_host_only_for_target_kl():
    hits = [m.group(0) for m in HOST_READS.finditer(_code(ppo.ppo_update))]
    assert hits == ["float("], hits  # the optional target-KL early stop, once per epoch
    assert "if hp.target_kl and float(" in _code(ppo.ppo_update)


def test_trainer_reads_metrics_once_per_update():
    assert _code(Trainer.train).count(".tolist()") == 0
    assert _code(Trainer._summarise).count(".tolist()") == 1


# On CUDA: tests/test_cuda.py::test_cuda_rollout_and_update_never_synchronise (set_sync_debug_mode).


def test_rollout_reads_the_host_only_where_reading_is_free():
    # The CPU-only shortcuts (quiet steps skip episode bookkeeping and the non-finite count) read through
    # one helper, and only behind `host_branches`, which capture and CUDA graphs turn off.
    from phalanx import rollout

    step, checked = _code(Rollout.step), _code(Rollout._checked)
    assert not HOST_READS.search(step) and not HOST_READS.search(checked)
    for code in (step, checked):
        for line in code.splitlines():
            if "_read" in line:
                assert "self.host_branches" in line, line
    update = _code(Trainer.update)
    assert "self.run.rollout.every_step_active" in update
    for line in update.splitlines():
        if "every_step_active" in line:
            assert "self.run.rollout.host_branches" in line, line
    assert "None if every else trained" in update  # the one read, of the update's own mask
    # The step mode (fixed when the rollout is built) turns them off wherever a step is captured.
    assert "self.host_branches = cpu and not mode.host_free" in _code(Rollout.__init__)
    assert rollout.StepMode(compiled=True).host_free and rollout.StepMode(graphed=True).host_free
    assert "mode.host_free" in _code(graphs.CapturedSteps.__init__) or "host_free=mode.host_free" in _code(build._build)
    assert _code(rollout._read).count("bool(") == 1 and "isfinite(x.sum())" in _code(rollout._read_finite)


def test_rollout_calls_the_policy_once_a_step(tmp_path):
    """act and value in one call a step; what follows the last step is valued once after the loop (the
    step's own next value was a second policy call a step)."""
    t = Trainer(resolve(dict(env="cartpole", device="cpu", num_envs=4, num_steps=16, progress=False, tensorboard=False,
                             run_dir=str(tmp_path / "r"))))
    calls = {"act_value": 0, "value": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    t.run.rollout.act_value = counted("act_value", t.run.rollout.act_value)
    t.run.rollout.value = counted("value", t.run.rollout.value)
    try:
        t.collect()  # no cartpole episode is truncated in 16 steps: no final observation to value
    finally:
        t.close()
    assert calls == {"act_value": 16, "value": 1}


def test_cpu_update_drops_the_mask_only_where_every_step_was_active(tmp_path):
    """Where every learner slot acted at every step (reading which is free on the CPU), the update's batch
    carries no mask, so no mean tests one; where a slot was inactive, its row is dropped before the minibatches
    (PPOBatch.trained_rows) and what is left carries no mask either."""
    t = Trainer(resolve(dict(env="cartpole", device="cpu", num_envs=4, num_steps=16, progress=False, tensorboard=False,
                             run_dir=str(tmp_path / "r"))))
    try:
        t.collect()
        t.update()
        assert t._last_batch.mask is None
        t.collect()
        t.run.buffer["active"][3, 1] = False  # as a slot that left mid-rollout
        t.update()
        assert t._last_batch.mask is None and len(t._last_batch) == 4 * 16 - 1
    finally:
        t.close()
