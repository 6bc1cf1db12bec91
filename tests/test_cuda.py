"""On a CUDA GPU: the env contract on 'cuda', and --cuda-graphs replaying the eager run (skipped without CUDA)."""

import pytest
import torch

import phalanx
from phalanx.config import resolve
from phalanx.envs import make
from phalanx.envs.check import check_env
from phalanx.run_state import state_tensors
from phalanx.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WORKLOADS = {
    "cartpole": dict(env="cartpole", norm_obs=True, norm_reward=True),
    "bucket_brigade": dict(env="bucket_brigade"),
    "drone_swarm": dict(env="drone_swarm", model="role_attention", tf_width=16, hidden_sizes=[16]),
    "pixel_goal": dict(env="pixel_goal", model="cnn", cnn_channels=[4, 8, 8], cnn_dense=16),
    # A KV cache written in place; league opponents (scripted, the learner, the frozen bank) in the graph.
    "trial_nav": dict(env="trial_nav", model="transformer", tf_width=16, tf_layers=1, tf_heads=2, tf_horizon=4),
    "duel": dict(env="duel", env_options={"time_limit": 12}, hidden_sizes=[16], opponents="based:1,learner:1,self_play:1"),
}


@pytest.mark.parametrize("name", ["cartpole", "bucket_brigade", "drone_swarm", "trial_nav", "pixel_goal", "duel"])
def test_env_on_cuda_meets_the_contract(name):
    # 'cuda' names the device that tensors call 'cuda:0': the checker once refused every env made on 'cuda'.
    env = make(name, num_envs=8, device="cuda", seed=0)
    try:
        check_env(env)
    finally:
        env.close()


def test_vmas_worlds_live_on_cuda():
    pytest.importorskip("vmas")
    env = make("vmas:navigation", num_envs=8, device="cuda", seed=0)
    rec = env.step(torch.zeros(8, 3, 2, device="cuda"))
    assert {rec.obs.device.type, rec.state.device.type, rec.reward.device.type, rec.truncated.device.type} == {"cuda"}
    env.reset(seed=1)
    check_env(env)


def _trainer(tmp_path, name: str, tag: str, **extra) -> Trainer:
    cfg = dict(WORKLOADS[name], device="cuda", num_envs=32, num_steps=16, num_epochs=2, num_minibatches=4,
               progress=False, tensorboard=False, seed=3, run_dir=str(tmp_path / tag), **extra)
    return Trainer(resolve(cfg))


@pytest.fixture
def deterministic_cudnn():
    # cuDNN's convolution gradients add in varying order: two eager runs of the CNN drift apart by
    # rounding (explained variance differed by more than 1e-5 after 6 updates), graphs or not.
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = before


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_cuda_graphs_replay_what_the_eager_run_computes(tmp_path, name, deterministic_cudnn):
    """20 updates with the rollout step and the minibatch step replayed as CUDA graphs end within 1e-5 of
    the eager run: weights, Adam's moments, the envs' state and the metrics."""
    eager, graphed = _trainer(tmp_path, name, "eager"), _trainer(tmp_path, name, "graphs", cuda_graphs=True)
    try:
        for i in range(20):
            stats_e, stats_g = eager.collect(), graphed.collect()
            metrics_e, metrics_g = eager.update(), graphed.update()
            for k in stats_e:
                torch.testing.assert_close(stats_g[k], stats_e[k], atol=1e-5, rtol=1e-5, msg=f"update {i}: {k}")
            for k in metrics_e:
                torch.testing.assert_close(metrics_g[k], metrics_e[k], atol=1e-5, rtol=1e-5, msg=f"update {i}: {k}")
        assert graphed.run.rollout.steps.graph is not None and graphed.run.update_step._graphs  # recorded, and replayed since
        for (k, a), b in zip(eager.run.model.state_dict().items(), graphed.run.model.state_dict().values()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=k)
        state_e, state_g = state_tensors(eager), state_tensors(graphed)
        for k, v in state_e.items():
            if v.is_floating_point():
                torch.testing.assert_close(state_g[k], v, atol=1e-5, rtol=1e-5, msg=k)
            else:
                assert torch.equal(state_g[k], v), k
    finally:
        eager.close()
        graphed.close()


def test_cuda_graphs_resume_records_again(tmp_path):
    """A restored run replaces the tensors a recorded graph reads: it records a new one and goes on as the
    uninterrupted run does."""
    cfg = dict(WORKLOADS["cartpole"], device="cuda", num_envs=32, num_steps=16, num_minibatches=4, progress=False,
               tensorboard=False, seed=4, cuda_graphs=True, total_steps=32 * 16 * 8, checkpoint_every=32 * 16 * 4)
    full = phalanx.train(run_dir=tmp_path / "full", **cfg)
    phalanx.train(run_dir=tmp_path / "part", max_updates=4, **cfg)
    part = phalanx.train(resume=tmp_path / "part")
    for (k, a), b in zip(full.policy.model.state_dict().items(), part.policy.model.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_rollout_and_update_never_synchronise(tmp_path, graphs):
    t = _trainer(tmp_path, "cartpole", f"sync{graphs}", cuda_graphs=graphs)
    try:
        for _ in range(2):  # warm-up: allocations, cuBLAS handles, the graphs' recording
            t.collect()
            t.update()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            t.collect()
            t.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        t.close()
