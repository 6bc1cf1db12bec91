"""torch_threads 0: a thread count chosen from the work that does not collapse when the machine is shared."""

import os

import pytest
import torch

from phalanx import devices
from phalanx.config import resolve
from phalanx.trainer import Trainer

CPUS = 4  # the CPUs this process may use, as the tests below present them


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(CPUS)))


def test_small_calls_run_on_one_thread_and_large_ones_on_the_cpus_this_process_may_use(four_cpus):
    cpu, big = torch.device("cpu"), devices.THREADED_WORK
    small = devices.choose_threads(0, cpu, 32 * 9155, 512 * 9155)  # cartpole's defaults
    assert (small.collect, small.update) == (1, 1)
    mixed = devices.choose_threads(0, cpu, big - 1, big)  # a small rollout step, a large minibatch
    assert (mixed.collect, mixed.update) == (1, CPUS)
    assert "1 to collect, 4 to update (auto: 4 CPUs" in str(mixed)
    assert devices.choose_threads(0, cpu, big, big).collect == CPUS
    assert devices.choose_threads(0, cpu, 10**12, 10**12, local_ranks=CPUS * 2).update == 1  # ranks on a node share its CPUs
    assert devices.choose_threads(0, cpu, 10**12, 10**12, local_ranks=2).update == CPUS // 2
    assert devices.choose_threads(3, cpu, 32, 32) == devices.Threads(3, 3, "torch_threads")  # an explicit count is kept


@pytest.mark.parametrize(("over", "expected"), [
    (dict(env="cartpole", num_envs=32, num_steps=4), (1, 1)),
    (dict(env="cartpole", num_envs=2048, num_steps=4), (CPUS, CPUS)),
    # VMAS navigation's shape: 1,800 agents a step of a 256x256 MLP, 12,000-row minibatches (#30).
    (dict(env="cartpole", num_envs=32, num_steps=128, num_minibatches=1, hidden_sizes=[256, 256]), (1, CPUS)),
])
def test_the_trainer_applies_each_phase_count_and_prints_them(tmp_path, capsys, four_cpus, over, expected):
    torch.set_num_threads(CPUS + 1)  # neither answer
    t = Trainer(resolve(dict(device="cpu", progress=True, tensorboard=False, run_dir=str(tmp_path / "r"), **over)))
    try:
        assert torch.get_num_threads() == expected[0]
        t.collect()
        assert torch.get_num_threads() == expected[0]
        t.update()
        assert torch.get_num_threads() == expected[1]
        assert "torch threads: " in capsys.readouterr().err
    finally:
        t.close()


def test_openmp_threads_wait_passively_unless_the_user_says_otherwise():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import phalanx, os; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         check=True)
    assert out.stdout.strip() == "ACTIVE"


@pytest.mark.parametrize("torch_threads", [1, 2])
def test_the_initial_weights_depend_neither_on_the_threads_before_the_run_nor_on_its_own(tmp_path, torch_threads):
    """The model is built on one thread: an orthogonal init's QR rounds differently on other thread counts, so
    building first made two runs of one config in one process start apart (found when the env copy that
    measures memory moved the model's construction ahead of the thread choice), and a run's count (which
    depends on the machine) would change its start."""
    weights = []
    before = torch.get_num_threads()
    try:
        for i, threads in enumerate((2, 1)):
            torch.set_num_threads(threads)
            t = Trainer(resolve(dict(env="cartpole", num_envs=4, num_steps=8, torch_threads=torch_threads if i else 1,
                                     progress=False, tensorboard=False, hidden_sizes=[256, 256],
                                     run_dir=str(tmp_path / str(i)))))
            weights.append([p.detach().clone() for p in t.run.model.parameters()])
            t.close()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*weights))
