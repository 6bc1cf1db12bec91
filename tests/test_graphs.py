"""--cuda-graphs on any machine: the step-state bookkeeping that makes an eager step replayable (`fold`,
`own_memory`; the rollout's whole step state in tests/test_step_state.py), and the refusals. The recording and replay themselves are checked on CUDA (tests/test_cuda.py)."""

import pytest
import torch

import phalanx
from phalanx.errors import ConfigError
from phalanx.graphs import fold, own_memory


class Env:
    """An env that replaces its state tensors, makes a new dict of them, and writes one in place."""

    def __init__(self):
        self.pos = torch.zeros(4)
        self.st = {"hp": torch.ones(4), "t": torch.zeros(4, dtype=torch.long)}
        self.counter = torch.zeros(4)

    def step_state(self):
        return {"pos": self.pos, "hp": self.st["hp"], "t": self.st["t"]}

    def load_step_state(self, state):
        self.pos, self.st = state["pos"], {"hp": state["hp"], "t": state["t"]}

    def step(self):
        self.pos = self.pos + 1
        self.st = {"hp": self.st["hp"] * 2, "t": self.st["t"] + 1}
        self.counter.add_(3)
        return self.pos  # the record's observation is the env's own tensor


def test_fold_brings_replaced_state_back_into_the_recorded_tensors():
    env = Env()
    recorded = own_memory({**env.step_state(), "obs": env.pos})
    env.load_step_state(recorded)
    pos, hp, t, obs = recorded["pos"], recorded["hp"], recorded["t"], recorded["obs"]
    # The observation was the env's own `pos` tensor: named twice, it got memory of its own.
    assert obs.untyped_storage().data_ptr() != pos.untyped_storage().data_ptr()
    for _ in range(3):
        out = env.step()
        fold(recorded, {**env.step_state(), "obs": out})
        env.load_step_state(recorded)
    # The same tensors (the addresses a graph reads), holding the values the eager steps computed.
    assert env.pos is pos and env.st["hp"] is hp and env.st["t"] is t
    assert pos.tolist() == [3.0] * 4 and hp.tolist() == [8.0] * 4 and t.tolist() == [3] * 4
    assert obs.tolist() == [3.0] * 4 and env.counter.tolist() == [9.0] * 4


def test_fold_refuses_a_step_that_changes_its_state():
    x = torch.zeros(3)
    with pytest.raises(ConfigError, match=r"cuda_graphs.*'x' from torch.float32 \[3\] into torch.float32 \[4\]"):
        fold({"x": x}, {"x": torch.zeros(4)})
    with pytest.raises(ConfigError, match="dropped 'x'"):
        fold({"x": x}, {})
    with pytest.raises(ConfigError, match="added state 'y'"):
        fold({"x": x}, {"x": x, "y": x})


def test_own_memory_gives_each_entry_memory_of_its_own():
    shared = torch.zeros(4)
    owned = own_memory({"a": shared, "b": shared, "c": shared[:2], "d": torch.zeros(1).expand(3)})
    assert owned["a"] is shared  # the first keeps its tensor
    ptrs = {v.untyped_storage().data_ptr() for v in owned.values()}
    assert len(ptrs) == 4 and owned["d"].stride() == (1,)


def test_cuda_graphs_are_refused_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="'cuda_graphs' needs a CUDA device"):
        phalanx.train(env="cartpole", cuda_graphs=True, device="cpu", total_steps=2048, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()
