"""Vectorized torch environments, the env protocol and adapters."""

# Registration side effects: each module registers its environments.
from phalanx.envs import bucket_brigade as _bucket_brigade  # noqa: F401,E402
from phalanx.envs import cartpole as _cartpole  # noqa: F401,E402
from phalanx.envs import drone_swarm as _drone_swarm  # noqa: F401,E402
from phalanx.envs import duel as _duel  # noqa: F401,E402
from phalanx.envs import gym_adapter as _gym_adapter  # noqa: F401,E402
from phalanx.envs import pendulum as _pendulum  # noqa: F401,E402
from phalanx.envs import pettingzoo_adapter as _pettingzoo_adapter  # noqa: F401,E402
from phalanx.envs import pixel_goal as _pixel_goal  # noqa: F401,E402
from phalanx.envs import trial_nav as _trial_nav  # noqa: F401,E402
from phalanx.envs import vmas_adapter as _vmas_adapter  # noqa: F401,E402
from phalanx.envs.base import StepRecord, VecEnv, generator_state, set_generator_state
from phalanx.envs.check import check_env
from phalanx.envs.gym_export import to_gymnasium, to_sb3
from phalanx.envs.pettingzoo_adapter import to_pettingzoo
from phalanx.envs.registry import EnvOption, EnvSpec, make, register, register_prefix, registered, spec
from phalanx.envs.spaces import ActionError, Box, Discrete, MultiDiscrete

__all__ = [
    "ActionError", "Box", "Discrete", "EnvOption", "EnvSpec", "MultiDiscrete", "StepRecord", "VecEnv",
    "check_env", "generator_state", "make", "register", "register_prefix", "registered", "set_generator_state", "spec",
    "to_gymnasium", "to_pettingzoo", "to_sb3",
]
