"""--compile: the compiled run agrees with the eager one and compiles only during its first updates."""

import pytest
import torch

import phalanx
from phalanx.algo import compile_step
from phalanx.config import resolve
from phalanx.rollout import StepMode
from phalanx.run_state import rollout_tensors
from phalanx.trainer import Trainer

CFG = dict(env="cartpole", total_steps=512 * 4, num_envs=8, num_steps=64, num_minibatches=2, progress=False,
           tensorboard=False, seed=3)

# The rollout's step compiled whole as --compile captures it, by a backend that needs no C++ toolchain.
CAPTURED = StepMode(compiled=True, backend="aot_eager")


def _inductor_works() -> bool:
    try:  # inductor on CPU needs a C++ compiler and Python headers on the machine
        return bool(torch.compile(lambda x: x * 2 + 1)(torch.ones(3)).eq(3).all())
    except Exception:
        return False


@pytest.mark.slow
def test_compiled_matches_eager_and_does_not_recompile(tmp_path):
    from torch._dynamo.utils import counters

    if not _inductor_works():
        pytest.skip("torch.compile's inductor backend cannot build on this machine (no C++ toolchain)")

    eager = phalanx.train(run_dir=tmp_path / "eager", **CFG)
    t = Trainer(resolve(dict(CFG, compile=True, run_dir=str(tmp_path / "comp"))))
    try:
        t.train(max_updates=2)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0
        t.train(max_updates=2)
        assert counters["stats"]["unique_graphs"] == graphs  # later updates reuse the compiled graphs
        for (k, a), b in zip(eager.policy.model.state_dict().items(), t.run.model.state_dict().values()):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=k)
    finally:
        t.close()


SMALL_MEMORY = dict(lstm_hidden=16, tf_width=16, tf_layers=1, tf_heads=2, tf_horizon=4, hidden_sizes=[16])
FULLGRAPH = {
    "mlp": dict(env="cartpole"),
    "cnn": dict(env="pixel_goal", cnn_channels=[4, 8, 8], cnn_dense=16),
    "role_attention": dict(env="drone_swarm", tf_width=16, hidden_sizes=[16]),
    # Memory models: whole segments per minibatch, and (trial_nav) parked slots, so the loss keeps its mask.
    "lstm": dict(env="cartpole", **SMALL_MEMORY),
    "transformer": dict(env="trial_nav", **SMALL_MEMORY),
    "strategy": dict(env="duel", opponents="", strategy_history=4, **SMALL_MEMORY),
}


@pytest.mark.parametrize("model", sorted(FULLGRAPH))
def test_update_step_is_one_graph_and_never_recompiles(tmp_path, model):
    """The minibatch update step (forward, losses, gradients, clip, Adam) of every model is captured whole by
    torch.compile(fullgraph=True) (a graph break would raise) and compiled once: its first call sees Adam's state
    as every later one does (created inside the first call, it was compiled again at the second)."""
    from torch._dynamo.backends.registry import lookup_backend

    torch._dynamo.reset()
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example_inputs)

    cfg = resolve(dict(FULLGRAPH[model], model=model, num_envs=4, num_steps=8, num_epochs=2, num_minibatches=2,
                       progress=False, tensorboard=False, run_dir=str(tmp_path / model)))
    t = Trainer(cfg)
    try:
        t.compile_update(backend=counting_backend)
        before = [p.detach().clone() for p in t.run.model.parameters()]
        for _ in range(3):  # 2 epochs x 2 minibatches of one size an update: 12 calls
            t.collect()
            metrics = t.update()
        assert any(not torch.equal(b, p) for b, p in zip(before, t.run.model.parameters()))
        assert all(torch.isfinite(v) for v in metrics.values())
        assert len(compiles) == 1, compiles
    finally:
        t.close()


def test_compiled_update_step_calls_no_foreach_kernels(tmp_path):
    """Inductor on CUDA (torch 2.11) failed an internal assertion fusing torch's foreach kernels
    (Scheduler.reorder_loops_by_dep_pair on a ForeachKernelSchedulerNode), so `--compile` could not build
    the update step on a GPU: the graph handed to the backend holds the clip and Adam in per-tensor form."""
    torch._dynamo.reset()
    ops: list[str] = []

    def recording_backend(gm, example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    t = Trainer(resolve(dict(CFG, num_envs=4, num_steps=8, run_dir=str(tmp_path / "r"))))
    try:
        t.run.update_step = compile_step(t.run.update_step, dynamic=False, backend=recording_backend)
        before = [p.detach().clone() for p in t.run.model.parameters()]
        t.collect()
        t.update()
        assert any(not torch.equal(b, p) for b, p in zip(before, t.run.model.parameters()))  # Adam ran in the graph
        assert ops and not [op for op in ops if "_foreach_" in op], sorted({op for op in ops if "_foreach_" in op})
    finally:
        t.close()


ROLLOUT = {
    # Observation and reward normalisers on: their running statistics are written inside the graph.
    "mlp": dict(model="mlp", env="cartpole", norm_obs=True, norm_reward=True),
    "cnn": dict(model="cnn", env="pixel_goal", cnn_channels=[4, 8, 8], cnn_dense=16),
    "role_attention": dict(model="role_attention", env="drone_swarm", tf_width=16, hidden_sizes=[16]),
    # Memory models: the LSTM state and the KV cache are written in place inside the graph.
    "lstm": dict(model="lstm", env="pendulum", norm_obs=True, norm_reward=True, num_minibatches=2, **SMALL_MEMORY),
    "transformer": dict(model="transformer", env="trial_nav", **SMALL_MEMORY),
    "transformer-mappo": dict(model="transformer", env="bucket_brigade", critic="mappo", env_options={"max_nights": 5},
                              teammates="hero", **SMALL_MEMORY),
    # strategy: in test_captured_league_step_is_one_graph_with_a_growing_pool (with truncated steps).
    "lstm-cnn": dict(model="lstm", env="pixel_goal", cnn_channels=[4, 8, 8], cnn_dense=16, **SMALL_MEMORY),
    # Scripted teammates draw through the rollout's Draws, so they replay inside the graph too.
    "teammates": dict(model="mlp", env="bucket_brigade", teammates="hero,random", env_options={"max_nights": 5}),
}


@pytest.mark.parametrize("case", sorted(ROLLOUT))
def test_rollout_step_is_one_graph_and_draws_what_eager_draws(tmp_path, case):
    """One rollout step (act, env step, buffer writes, episode statistics, memory) of every model is captured
    whole (fullgraph: a break raises), is reused for every step after warm-up, and fills the buffers bit for
    bit as the eager rollout does: the random draws are replayed, not redrawn. Updates run between collects,
    so later collects act with trained weights; the carried state (memory, counters, env) stays equal."""
    torch._dynamo.reset()
    make = lambda name, **kw: Trainer(resolve(dict(ROLLOUT[case], num_envs=4, num_steps=8, progress=False,  # noqa: E731
                                             tensorboard=False, run_dir=str(tmp_path / name))), **kw)
    eager, captured = make("eager"), make("captured", step_mode=CAPTURED)
    try:
        assert captured.run.env.capturable
        for i in range(3):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                stats_e, stats_c = eager.collect(), captured.collect()
            for k, buf in eager.run.buffer.items():
                assert torch.equal(buf, captured.run.buffer[k]), (i, k)
            for k, v in stats_e.items():
                assert torch.equal(v, stats_c[k]), (i, k)
            eager.update(), captured.update()
        state_e, state_c = rollout_tensors(eager.run.rollout), rollout_tensors(captured.run.rollout)
        assert state_e.keys() == state_c.keys()
        for k, v in state_e.items():
            assert torch.equal(v, state_c[k]), k
        assert torch.equal(eager.run.env.gen.get_state(), captured.run.env.gen.get_state())
        assert torch.equal(eager.run.gen.get_state(), captured.run.gen.get_state())
    finally:
        eager.close()
        captured.close()


FINALS = {
    # Every env truncates on the same step (nothing ends sooner in 5 steps).
    "cartpole": dict(env="cartpole", critic="ippo", env_options={"max_steps": 5}),
    "bucket_brigade-mappo": dict(env="bucket_brigade", critic="mappo", env_options={"max_nights": 5}),
    # An IPPO critic on an env with a state (a kept final state raised KeyError 'final_states' once).
    "bucket_brigade-ippo": dict(env="bucket_brigade", critic="ippo", env_options={"max_nights": 5}),
    # Terminations stagger the episodes, so one rollout truncates on different steps (3rd collect: steps 4 and 7).
    "cartpole-staggered": dict(env="cartpole", critic="ippo", env_options={"max_steps": 12}, seed=5),
    # Pixels: some envs end at the goal, so a step truncates some envs, not all (3rd collect: 7 of 8 at step 4).
    "pixel_goal-staggered": dict(env="pixel_goal", model="cnn", cnn_channels=[4, 8, 8], cnn_dense=16, num_envs=8, seed=5, norm_obs=False,
                                 env_options={"max_steps": 7, "k": 1, "start": "any"}),
}


@pytest.mark.parametrize("case", sorted(FINALS))
def test_captured_rollout_values_truncated_final_observations_as_eager_does(tmp_path, case):
    """A captured CPU step leaves V(final_obs) (MAPPO: of the final state) to a critic call after it, over the
    envs truncated at that step, as the eager step makes it: the bootstraps, and every buffer, equal eager's bit
    for bit, also where truncations fall on different steps of one rollout or on some envs of a step (the CPU's
    matrix products round by row count: one call over the whole rollout's truncated rows, or over every env in
    the step, put bootstraps 1e-7 from eager's)."""
    torch._dynamo.reset()
    make = lambda name, **kw: Trainer(resolve(dict(dict(norm_obs=True, num_envs=4), **FINALS[case], num_steps=8,  # noqa: E731
                                             progress=False, tensorboard=False, run_dir=str(tmp_path / name))), **kw)
    eager, captured = make("eager"), make("captured", step_mode=CAPTURED)
    try:
        staggered, truncated_per_step = case.endswith("staggered"), set()
        for i in range(3):
            eager.collect(), captured.collect()
            truncated = eager.run.buffer["truncated"].flatten(2).any(2)  # [T, N]: the envs truncated at each step
            assert truncated.any() or staggered, i
            if truncated.any():
                truncated_per_step.add((int(truncated.any(1).sum()), int(truncated.sum(1).max())))
            for k, buf in eager.run.buffer.items():
                assert torch.equal(buf, captured.run.buffer[k]), (i, k)
        n = captured.run.rollout.N
        # The staggered cases see a rollout truncate on several steps, or at a step truncate some envs only.
        assert not staggered or any(steps > 1 or 0 < envs < n for steps, envs in truncated_per_step), truncated_per_step
    finally:
        eager.close()
        captured.close()


LEAGUE = {
    "mlp": dict(model="mlp", hidden_sizes=[16]),
    # strategy's memory is a KV cache (the strategy encoder) and an LSTM core: both kinds, in one model (a separate
    # lstm case took 45 s more of the suite and tested no path this one does not).
    "strategy": dict(model="strategy", strategy_history=4, **SMALL_MEMORY),
}


@pytest.mark.parametrize("model", sorted(LEAGUE))
def test_captured_league_step_is_one_graph_with_a_growing_pool(tmp_path, model):
    """With league opponents (scripted, the learner, snapshots in the frozen bank) the rollout step is one graph,
    never recompiled as snapshots enter the bank and short matches draw new opponents, and it fills every
    buffer, the assignments and the game counts bit for bit as the same step run eagerly (on the CPU the eager
    rollout forwards each snapshot over its own envs' rows; the graph runs every player over every env).
    Matches of 6 steps: truncated steps, whose bootstrap a memory critic values from that step's memory."""
    torch._dynamo.reset()
    make = lambda name, **kw: Trainer(resolve(dict(  # noqa: E731
        LEAGUE[model], env="duel", env_options={"time_limit": 6}, opponents="self_play:2,based:1,learner:1", pool_size=2,
        snapshot_every=32, num_envs=4, num_steps=8, num_minibatches=2, progress=False, tensorboard=False,
        run_dir=str(tmp_path / name))), **kw)
    eager, captured = make("eager"), make("captured", step_mode=CAPTURED)
    try:
        # The captured step's path, run eagerly: every player over every env.
        eager.run.league.select_rows = False
        assigned = set()
        for i in range(4):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                eager.collect(), captured.collect()
            for k, buf in eager.run.buffer.items():
                assert torch.equal(buf, captured.run.buffer[k]), (i, k)
            for t in (eager, captured):
                t.update()
                t.run.league.end_update(32 * (i + 1), t.run.model, t.run.norms.obs)
            assert torch.equal(eager.run.league.assign, captured.run.league.assign), i
            assigned |= set(captured.run.league.assign.tolist())
        assert [o and o.name for o in eager.run.league.players] == [o and o.name for o in captured.run.league.players]
        assert sum(o is not None and o.kind == "snapshot" for o in captured.run.league.players) == 3
        assert len(assigned) > 1
        assert torch.equal(eager.run.gen.get_state(), captured.run.gen.get_state())
    finally:
        eager.close()
        captured.close()
