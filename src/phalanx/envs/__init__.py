"""The env protocol: the batched env interface (base, spaces), the name registry, the contract checker,
drawing helpers and the multi-trial wrapper.

The adapters (gymnasium, PettingZoo, VMAS, and the export to gymnasium / SB3) live in
`phalanx.envs.adapters`, the built-in workloads in `phalanx.zoo`; neither is imported here. The
registry imports the module behind a built-in name the first time that name is asked for
(`phalanx.envs.registry`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from phalanx.envs.base import StepRecord, VecEnv, generator_state, set_generator_state
from phalanx.envs.check import check_env
from phalanx.envs.registry import EnvOption, EnvSpec, make, register, register_prefix, registered, spec
from phalanx.envs.spaces import ActionError, Box, Discrete, MultiDiscrete

if TYPE_CHECKING:
    from phalanx.envs.adapters.gym_export import to_gymnasium, to_sb3
    from phalanx.envs.adapters.pettingzoo import to_pettingzoo

# The exports to other libraries, imported on first use. Users and the README reach them as
# `phalanx.envs.to_gymnasium` / `to_sb3` / `to_pettingzoo`, so they stay names of this package; importing
# them above would import the adapters with every `import phalanx.config` (which imports this package,
# through phalanx.envs.registry), the very coupling the split into envs / envs.adapters / zoo removes.
_ADAPTED = {"to_gymnasium": "phalanx.envs.adapters.gym_export", "to_sb3": "phalanx.envs.adapters.gym_export",
            "to_pettingzoo": "phalanx.envs.adapters.pettingzoo"}

__all__ = [
    "ActionError", "Box", "Discrete", "EnvOption", "EnvSpec", "MultiDiscrete", "StepRecord", "VecEnv",
    "check_env", "generator_state", "make", "register", "register_prefix", "registered", "set_generator_state", "spec",
    "to_gymnasium", "to_pettingzoo", "to_sb3",
]


def __getattr__(name: str) -> Any:
    if name not in _ADAPTED:
        raise AttributeError(f"module 'phalanx.envs' has no attribute {name!r}")
    value = getattr(importlib.import_module(_ADAPTED[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
