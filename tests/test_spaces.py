"""Spaces are checked and normalised once, when built: a Box takes its bounds the gymnasium way (scalars,
sequences, numpy arrays or tensors broadcastable to `shape`) and holds them as flat tuples of floats; a space
built wrongly is refused there, in one line naming the space and what is allowed."""

import dataclasses
import math
import sys

import numpy as np
import pytest
import torch

from phalanx.cli import main
from phalanx.envs import Box, Discrete, MultiDiscrete, registry
from phalanx.errors import EnvContractError


@pytest.mark.parametrize("low, high", [
    (0.0, 1.0),
    (0, 1),
    ([0.0], [1.0]),
    ((0.0, 0.0), (1.0, 1.0)),
    (np.zeros(2), np.ones(2, dtype=np.float32)),
    (np.float32(0.0), np.int64(1)),
    (torch.zeros(2), torch.tensor(1.0)),
    (torch.zeros(1, dtype=torch.float16), torch.ones(2, dtype=torch.int32)),
], ids=["floats", "ints", "one-element lists", "tuples", "numpy arrays", "numpy scalars", "tensors", "mixed"])
def test_box_takes_bounds_broadcastable_to_its_shape(low, high):
    box = Box(low=low, high=high, shape=(2,))
    assert box.low == (0.0, 0.0) and box.high == (1.0, 1.0) and box.shape == (2,)
    assert all(type(x) is float for x in box.low + box.high)
    assert box == Box.uniform(0.0, 1.0, (2,)) and hash(box) == hash(Box.uniform(0.0, 1.0, (2,)))
    assert box.low_tensor().shape == box.high_tensor().shape == (2,)
    assert box.describe() == "Box(shape=[2], low=0, high=1, dtype=float32)"
    gen = torch.Generator().manual_seed(0)
    x = box.sample(3, 2, gen, "cpu")
    assert x.shape == (3, 2, 2) and bool(((x >= 0) & (x <= 1)).all())


def test_box_bounds_broadcast_over_a_shape_of_several_axes_and_flatten_in_row_major_order():
    box = Box(low=[[-1.0], [-2.0]], high=np.array([1.0, 2.0, 3.0]), shape=(2, 3))
    assert box.low == (-1.0, -1.0, -1.0, -2.0, -2.0, -2.0)
    assert box.high == (1.0, 2.0, 3.0) * 2
    assert box.low_tensor().tolist() == [[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]
    assert Box(-1.0, 1.0, ()).low_tensor().shape == ()  # a scalar box


def test_box_keeps_infinite_bounds_and_python_float_precision():
    box = Box(low=(-math.inf, 4.8), high=math.inf, shape=[2])
    assert box.low == (-math.inf, 4.8) and box.high == (math.inf, math.inf) and box.shape == (2,)
    assert box.describe() == "Box(shape=[2], low=-inf, high=inf, dtype=float32)"


def test_box_without_a_shape_takes_it_from_its_bounds():
    assert Box(low=np.zeros((2, 3)), high=1.0).shape == (2, 3)
    assert Box(low=0.0, high=1.0).shape == (1,)  # as gymnasium: two numbers make a box of one


def test_box_stays_frozen_and_hashable():
    box = Box(0.0, 1.0, (2,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        box.low = (5.0, 5.0)
    assert {box: 1}[Box([0.0, 0.0], [1, 1], (2,))] == 1
    assert box != Box(0.0, 2.0, (2,))


def _refused(make, *words):
    with pytest.raises(EnvContractError) as e:
        make()
    message = str(e.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("kwargs, words", [
    (dict(low=math.nan, high=1.0, shape=(2,)), ["Box", "low", "NaN"]),
    (dict(low=0.0, high=[1.0, float("nan")], shape=(2,)), ["Box", "high", "NaN"]),
    (dict(low=1.0, high=0.0, shape=(2,)), ["Box", "low", "high", "index 0"]),
    (dict(low=[0.0, 2.0], high=1.0, shape=(2,)), ["Box", "index 1"]),
    (dict(low=math.inf, high=math.inf, shape=(2,)), ["Box", "low", "+inf"]),
    (dict(low=-1.0, high=-math.inf, shape=(2,)), ["Box", "high", "-inf"]),
    (dict(low=[0.0, 0.0, 0.0], high=1.0, shape=(2,)), ["Box", "low", "[3]", "broadcast", "[2]"]),
    (dict(low=0.0, high=[[1.0, 1.0]] * 3, shape=(2,)), ["Box", "high", "[3, 2]", "[2]"]),
    (dict(low="0", high=1.0, shape=(2,)), ["Box", "low", "number", "'0'"]),
    (dict(low=None, high=1.0, shape=(2,)), ["Box", "low", "None"]),
    (dict(low=[0.0, "a"], high=1.0, shape=(2,)), ["Box", "low", "number"]),
    (dict(low=[[0.0], [0.0, 1.0]], high=1.0, shape=(2,)), ["Box", "low", "number"]),
    (dict(low=False, high=True, shape=(2,)), ["Box", "low", "bool"]),
    (dict(low=np.zeros(2, dtype=bool), high=1.0, shape=(2,)), ["Box", "low", "bool"]),
    (dict(low=0.0, high=1 + 1j, shape=(2,)), ["Box", "high", "complex"]),
    (dict(low=0.0, high=1.0, shape=(2, -1)), ["Box", "shape", "positive ints", "-1"]),
    (dict(low=0.0, high=1.0, shape=(2.0,)), ["Box", "shape", "positive ints", "2.0"]),
    (dict(low=0.0, high=1.0, shape=(0,)), ["Box", "shape", "positive ints"]),
    (dict(low=0.0, high=1.0, shape=(True,)), ["Box", "shape", "positive ints"]),
    (dict(low=0.0, high=1.0, shape=2), ["Box", "shape", "tuple"]),
    (dict(low=0.0, high=1.0, shape=(2,), dtype="no such type"), ["Box", "dtype", "torch.float32"]),
], ids=lambda v: None if isinstance(v, list) else "-".join(map(repr, v.values()))[:60])
def test_box_refuses_a_wrong_bound_shape_or_dtype_in_one_line(kwargs, words):
    _refused(lambda: Box(**kwargs), *words)


@pytest.mark.parametrize("n", [0, -3, 2.0, True, "3", None])
def test_discrete_refuses_anything_but_a_positive_int(n):
    _refused(lambda: Discrete(n), "Discrete", "n must be a positive int", repr(n))


@pytest.mark.parametrize("slot_n, words", [
    ((3, 0), ["slot_n", "0"]),
    ((3, 5), ["slot_n", "<= n", "5"]),
    ((2.0, 3), ["slot_n", "2.0"]),
    (3, ["slot_n", "tuple"]),
])
def test_discrete_refuses_wrong_slot_counts(slot_n, words):
    _refused(lambda: Discrete(4, slot_n=slot_n), "Discrete", *words)


def test_discrete_normalises_integer_likes():
    d = Discrete(np.int64(4), slot_n=[2, np.int32(4)])
    assert d == Discrete(4, slot_n=(2, 4)) and type(d.n) is int and all(type(k) is int for k in d.slot_n)
    assert d.describe() == "Discrete(4, per slot [2, 4])"


@pytest.mark.parametrize("nvec, words", [
    ((), ["non-empty"]),
    ([], ["non-empty"]),
    ((2, 0), ["positive int", "0"]),
    ((2, -1), ["positive int", "-1"]),
    ((2.0, 3), ["positive int", "2.0"]),
    (np.array([2.0, 3.0]), ["positive int"]),
    ((True, 2), ["positive int", "True"]),
    (3, ["tuple"]),
    (np.array([[2, 3]]), ["positive int"]),
])
def test_multidiscrete_refuses_an_empty_or_non_integer_nvec(nvec, words):
    _refused(lambda: MultiDiscrete(nvec), "MultiDiscrete", "nvec", *words)


@pytest.mark.parametrize("gates, words", [
    (((2, 0, 1),), ["head 2", "[0, 2)"]),
    (((1, 1, 0),), ["on itself"]),
    (((1, 0, 3),), ["value 3", "[0, 3)"]),
    (((1, 0),), ["(head, on_head, value)"]),
    ((1, 0, 1), ["(head, on_head, value)"]),
    (5, ["(head, on_head, value)"]),
])
def test_multidiscrete_refuses_gates_outside_its_heads(gates, words):
    _refused(lambda: MultiDiscrete((3, 2), gates=gates), "MultiDiscrete", "gate", *words)


def test_multidiscrete_normalises_arrays_and_lists():
    m = MultiDiscrete(np.array([3, 2]), gates=[[1, 0, 2]])
    assert m == MultiDiscrete((3, 2), gates=((1, 0, 2),)) and all(type(k) is int for k in m.nvec)
    assert MultiDiscrete(torch.tensor([4, 5])).nvec == (4, 5)
    assert hash(m) == hash(MultiDiscrete((3, 2), gates=((1, 0, 2),)))


USER_ENV = '''
from phalanx.envs import Box
from tests.contract_envs import GoodEnv


class GymStyle(GoodEnv):
    observation_space = Box(low=-1.0, high=1.0, shape=(2,))
    state_space = Box(low=[0.0], high=[1.0], shape=(2,))


def make(num_envs=4, device="cpu", seed=0):
    return GymStyle(num_envs, device, seed)


def upside_down(num_envs=4, device="cpu", seed=0):
    env = GymStyle(num_envs, device, seed)
    env.observation_space = Box(low=1.0, high=-1.0, shape=(2,))
    return env
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "gymstyle.py").write_text(USER_ENV)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delitem(sys.modules, "gymstyle", raising=False)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_check_env_passes_a_box_written_the_gymnasium_way(user_module, capsys):
    assert main(["check-env", "gymstyle:make", "--steps", "16"]) == 0
    assert "every rule of the env contract holds" in capsys.readouterr().out


def test_check_env_refuses_a_box_built_wrongly_in_one_line(user_module, capsys):
    assert main(["check-env", "gymstyle:upside_down", "--steps", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("phalanx: error: Box") and "\n" not in err, err
    assert "low must be <= high" in err


@pytest.mark.parametrize("given, held", [(np.float32, torch.float32), (np.uint8, torch.uint8), ("float64", torch.float64),
                                         (torch.float16, torch.float16)])
def test_box_takes_a_numpy_dtype_as_gymnasium_does(given, held):
    assert Box(low=0.0, high=1.0, shape=(2,), dtype=given).dtype == held
