"""Phalanx: PPO for single- and multi-agent batched torch environments, on the device."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Before torch loads its OpenMP runtime, which reads this once: idle pool threads sleep instead of
# spinning. Spinning threads take the cores a descheduled sibling needs when anything else runs on the
# machine (2 threads beside one busy process: 27k steps/s spinning, 58k passive, at 4,096 cartpole envs).
# Small batches run on one thread (devices.choose_threads), where the pool is never woken.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from phalanx.version import __version__  # noqa: E402

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.envs import make
    from phalanx.policy import Policy, load
    from phalanx.trainer import RunResult, train

# The API, imported on first use: the `phalanx` command imports torch with the garbage collector off
# (phalanx.__main__), which it can only do where `import phalanx` has not already imported it.
_API = {"Config": "phalanx.config", "make": "phalanx.envs", "Policy": "phalanx.policy", "load": "phalanx.policy",
        "RunResult": "phalanx.trainer", "train": "phalanx.trainer"}

__all__ = ["Config", "Policy", "RunResult", "__version__", "load", "make", "train"]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
