"""torch_threads 0: a thread count chosen from the work that does not collapse when the machine is shared."""

import os

import pytest
import torch

from phalanx import runs
from phalanx.config import resolve
from phalanx.trainer import Trainer

CPUS = len(os.sched_getaffinity(0))


def test_small_batches_run_on_one_thread_and_large_ones_on_the_cpus_this_process_may_use():
    cpu = torch.device("cpu")
    assert runs.choose_threads(0, cpu, 32)[0] == 1
    assert runs.choose_threads(0, cpu, runs.THREADED_BATCH - 1)[0] == 1
    assert runs.choose_threads(0, cpu, runs.THREADED_BATCH)[0] == CPUS
    assert runs.choose_threads(0, cpu, 10**6, local_ranks=CPUS * 2)[0] == 1  # ranks on a node share its CPUs
    assert runs.choose_threads(0, cpu, 10**6, local_ranks=2)[0] == max(1, CPUS // 2)
    assert runs.choose_threads(3, cpu, 32) == (3, "torch_threads")  # an explicit count is kept


@pytest.mark.parametrize(("num_envs", "expected"), [(32, 1), (runs.THREADED_BATCH, CPUS)])
def test_the_trainer_applies_and_prints_the_count(tmp_path, capsys, num_envs, expected):
    torch.set_num_threads(CPUS + 1)  # neither answer
    t = Trainer(resolve(dict(env="cartpole", device="cpu", num_envs=num_envs, num_steps=4, progress=True, tensorboard=False,
                             run_dir=str(tmp_path / "r"))))
    try:
        assert torch.get_num_threads() == expected
        assert f"torch threads: {expected} (auto: " in capsys.readouterr().err
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


def test_the_initial_weights_do_not_depend_on_the_threads_in_effect_before_the_run(tmp_path):
    """The count is applied before the model is built: an orthogonal init's QR rounds differently on other thread
    counts, so building first made two runs of one config in one process start apart (found when the env copy
    that measures memory moved the model's construction ahead of the thread choice)."""
    weights = []
    before = torch.get_num_threads()
    try:
        for i, threads in enumerate((2, 1)):
            torch.set_num_threads(threads)
            t = Trainer(resolve(dict(env="cartpole", num_envs=4, num_steps=8, torch_threads=1, progress=False,
                                     tensorboard=False, hidden_sizes=[256, 256], run_dir=str(tmp_path / str(i)))))
            weights.append([p.detach().clone() for p in t.model.parameters()])
            t.close()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*weights))
