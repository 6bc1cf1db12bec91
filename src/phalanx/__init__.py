"""Phalanx: PPO for single- and multi-agent batched torch environments, on the device."""

from phalanx.config import Config  # noqa: E402
from phalanx.envs import make  # noqa: E402
from phalanx.policy import Policy, load  # noqa: E402
from phalanx.trainer import RunResult, train  # noqa: E402
from phalanx.version import __version__  # noqa: E402

__all__ = ["Config", "Policy", "RunResult", "__version__", "load", "make", "train"]
