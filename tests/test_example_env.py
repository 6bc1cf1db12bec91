"""examples/rendezvous: a multi-agent env written only against the public API, checked, trained and
evaluated from the command line through the plugin path, from its own directory."""

import json
import sys
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.envs import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rendezvous"


@pytest.fixture
def in_example(monkeypatch):
    monkeypatch.chdir(EXAMPLE)
    monkeypatch.setattr(sys, "path", list(sys.path))
    # Without any rendezvous name another test registered: its module is gone from sys.modules (deleted below).
    monkeypatch.setattr(registry, "_REGISTRY", {k: v for k, v in registry._REGISTRY.items() if not k.startswith("rendezvous:")})
    monkeypatch.delitem(sys.modules, "rendezvous", raising=False)


def test_example_keeps_the_contract(in_example, capsys):
    assert main(["check-env", "rendezvous:make", "--steps", "32"]) == 0
    assert main(["check-env", "rendezvous:spec", "--size", "7", "--steps", "32"]) == 0


@pytest.mark.slow
def test_example_learns_to_meet_faster_than_random_play(in_example, tmp_path, capsys, monkeypatch):
    """Seed 1, 40k steps (~4 s): the greedy team meets in far fewer steps than random play and earns more."""
    run = tmp_path / "run"
    assert main(["train", "--env", "rendezvous:spec", "--total-steps", "40000", "--seed", "1", "--progress", "false",
                 "--tensorboard", "false", "--run-dir", str(run)]) == 0
    assert json.loads((run / "config.json").read_text())["env"] == "rendezvous:spec"
    capsys.readouterr()
    # Evaluated from another directory: the run's manifest says where the plugin module was found.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != EXAMPLE and p not in ("", ".")])
    monkeypatch.delitem(sys.modules, "rendezvous", raising=False)
    monkeypatch.setattr(registry, "_REGISTRY", {k: v for k, v in registry._REGISTRY.items() if k != "rendezvous:spec"})
    assert main(["eval", str(run), "--episodes", "200", "--vs", "random", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    learned, rand = res["learned"], res["random"]
    assert learned["mean_met"] >= 0.95
    assert learned["mean_length"] <= 0.5 * rand["mean_length"], (learned, rand)
    assert learned["mean_return"] >= rand["mean_return"] + 0.5, (learned, rand)


def test_example_trains_with_a_centralized_critic_from_its_state(in_example, tmp_path):
    assert main(["train", "--env", "rendezvous:make", "--critic", "mappo", "--total-steps", "1024", "--num-envs", "8",
                 "--num-steps", "16", "--progress", "false", "--tensorboard", "false", "--run-dir", str(tmp_path / "m")]) == 0


@pytest.mark.parametrize("model", ["mlp", "lstm"])
def test_example_rollout_step_is_captured_whole_as_eager_runs_it(in_example, tmp_path, model):
    """--compile captures the example's whole rollout step (its draws go through `self.rng`), with a memory model
    too: one graph after warm-up, every buffer and the LSTM state bit for bit as the eager rollout's."""
    import torch

    from phalanx.config import resolve
    from phalanx.rollout import StepMode
    from phalanx.run_state import rollout_tensors
    from phalanx.trainer import Trainer

    torch._dynamo.reset()
    CAPTURED = StepMode(compiled=True, backend="aot_eager")  # noqa: N806
    make = lambda name, **kw: Trainer(resolve(dict(env="rendezvous:make", model=model, lstm_hidden=16, hidden_sizes=[16],  # noqa: E731
                                             num_envs=4, num_steps=8, num_minibatches=2, progress=False, tensorboard=False,
                                             run_dir=str(tmp_path / name))), **kw)
    eager, captured = make("eager"), make("captured", step_mode=CAPTURED)
    try:
        for i in range(3):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                eager.collect(), captured.collect()
            for k, buf in eager.run.buffer.items():
                assert torch.equal(buf, captured.run.buffer[k]), (i, k)
            eager.update(), captured.update()
        for k, v in rollout_tensors(eager.run.rollout).items():
            assert torch.equal(v, rollout_tensors(captured.run.rollout)[k]), k
    finally:
        eager.close()
        captured.close()
