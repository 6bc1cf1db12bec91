"""--cuda-graphs on any machine: the carried-state bookkeeping that makes an eager step replayable, and
the refusals. The recording and replay themselves are checked on CUDA (tests/test_cuda.py)."""

from dataclasses import dataclass

import pytest
import torch

import phalanx
from phalanx.errors import ConfigError
from phalanx.graphs import Carried


@dataclass
class Record:
    obs: torch.Tensor
    info: dict


class Env:
    def __init__(self):
        self.pos = torch.zeros(4)
        self.st = {"hp": torch.ones(4), "t": torch.zeros(4, dtype=torch.long)}
        self.counter = torch.zeros(4)

    def step(self):
        self.pos = self.pos + 1  # replaced
        self.st = {"hp": self.st["hp"] * 2, "t": self.st["t"] + 1}  # a new dict of new tensors
        self.counter.add_(3)  # in place
        return Record(self.pos, {"hit": self.pos > 1})


class Loop:
    def __init__(self, env):
        self.env = env
        self.record = Record(env.pos, {"hit": torch.zeros(4, dtype=torch.bool)})

    def step(self):
        self.record = self.env.step()


def test_fold_brings_replaced_state_back_into_the_recorded_tensors():
    env = Env()
    loop = Loop(env)
    carried = Carried({"loop": loop, "env": env}, device_type="cpu")
    pos, hp, t, record, obs, hit = env.pos, env.st["hp"], env.st["t"], loop.record, loop.record.obs, loop.record.info["hit"]
    # The record's obs was the env's own `pos` tensor: carried under two names, it got its own copy.
    assert obs is not pos and obs.untyped_storage().data_ptr() != pos.untyped_storage().data_ptr()
    for _ in range(3):
        loop.step()
        carried.fold()
    # The same tensors (the addresses a graph reads), holding the values the eager steps computed.
    assert env.pos is pos and env.st["hp"] is hp and env.st["t"] is t
    assert loop.record is record and loop.record.obs is obs and loop.record.info["hit"] is hit
    assert pos.tolist() == [3.0] * 4 and hp.tolist() == [8.0] * 4 and t.tolist() == [3] * 4
    assert obs.tolist() == [3.0] * 4 and hit.all() and env.counter.tolist() == [9.0] * 4


def test_fold_refuses_state_that_changes_shape_or_disappears():
    env = Env()
    carried = Carried({"env": env}, device_type="cpu")
    env.pos = torch.zeros(5)
    with pytest.raises(ConfigError, match=r"cuda_graphs.*'env.pos' from torch.float32 \[4\] into torch.float32 \[5\]"):
        carried.fold()
    env = Env()
    carried = Carried({"env": env}, device_type="cpu")
    env.st = {"hp": env.st["hp"]}
    with pytest.raises(ConfigError, match=r"cuda_graphs.*dropped 'env.st.t'"):
        carried.fold()


def test_cuda_graphs_are_refused_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="'cuda_graphs' needs a CUDA device"):
        phalanx.train(env="cartpole", cuda_graphs=True, device="cpu", total_steps=64, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()
