"""Phalanx: PPO for single- and multi-agent batched torch environments, on the device."""

import os

# Before torch loads its OpenMP runtime, which reads this once: idle pool threads sleep instead of
# spinning. Spinning threads take the cores a descheduled sibling needs when anything else runs on the
# machine (2 threads beside one busy process: 27k steps/s spinning, 58k passive, at 4,096 cartpole envs).
# Small batches run on one thread (runs.choose_threads), where the pool is never woken.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from phalanx.config import Config  # noqa: E402
from phalanx.envs import make  # noqa: E402
from phalanx.policy import Policy, load  # noqa: E402
from phalanx.trainer import RunResult, train  # noqa: E402
from phalanx.version import __version__  # noqa: E402

__all__ = ["Config", "Policy", "RunResult", "__version__", "load", "make", "train"]
