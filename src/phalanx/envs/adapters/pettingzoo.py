"""PettingZoo interop, both ways.

* `to_pettingzoo(env, index)`: one environment of a phalanx batch as a PettingZoo `ParallelEnv`.
* `pz:<module>:<factory>`: any importable function returning a PettingZoo `ParallelEnv` or a turn-based
  `AECEnv` as a phalanx `VecEnv` over N copies, e.g. `phalanx train --env pz:mypkg.envs:make_env` (module
  `mypkg.envs`, function `make_env`), or `pz:pettingzoo.classic.tictactoe_v3:env`.

pettingzoo (and gymnasium) are imported lazily, inside functions: `import phalanx` works without them.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from phalanx.envs.adapters.pettingzoo_export import to_pettingzoo
from phalanx.envs.adapters.pettingzoo_parallel import PettingZooVecEnv, _require_pettingzoo
from phalanx.envs.adapters.pettingzoo_turns import PettingZooTurnsVecEnv
from phalanx.envs.registry import register_prefix
from phalanx.errors import ConfigError


def _load_factory(rest: str) -> Any:
    if rest.count(":") != 1 or not all(rest.split(":")):
        raise ConfigError(f"env 'pz:{rest}' must be named pz:<module>:<factory> (e.g. pz:mypkg.envs:make_env)")
    module_name, attr = rest.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"env 'pz:{rest}': cannot import module '{module_name}': {str(e).splitlines()[0]}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"env 'pz:{rest}': module '{module_name}' has no '{attr}'") from None
        except ImportError as e:  # packages that load submodules lazily (pettingzoo.classic, ...)
            raise ConfigError(f"env 'pz:{rest}': cannot import '{attr}': {str(e).splitlines()[0]}") from None
    if not callable(obj):
        raise ConfigError(f"env 'pz:{rest}': '{attr}' is not callable")
    return obj

def _build(factory: Any, rest: str, options: dict[str, Any]) -> Any:
    try:
        env = factory(**options)
    except TypeError as e:
        raise ConfigError(f"env 'pz:{rest}' rejected options {options}: {str(e).splitlines()[0]}") from None
    except ImportError as e:
        raise ConfigError(f"env 'pz:{rest}' needs a missing package: {str(e).splitlines()[0]}") from None
    needs = ("possible_agents", "reset", "step", "observation_space", "action_space")
    if _is_aec(env):
        needs += ("last", "observe")  # agents and agent_selection exist from the first reset on
    missing = [k for k in needs if not hasattr(env, k)]
    if missing:
        kind = "AEC env" if _is_aec(env) else "ParallelEnv"
        raise ConfigError(f"env 'pz:{rest}': the factory returned {type(env).__name__}, not a PettingZoo {kind} "
                          f"(it has no {', '.join(missing)})")
    return env


def _build_copies(factory: Any, rest: str, options: dict[str, Any], num_envs: int) -> list[Any]:
    """`num_envs` copies; where the env lists the rgb_array render mode and the options name none, made in it, so that
    `phalanx eval --record` can draw them (PettingZoo's envs draw only on `render()` in that mode)."""
    first = _build(factory, rest, options)
    if "render_mode" in options or "rgb_array" not in (getattr(first, "metadata", None) or {}).get("render_modes", ()):
        return [first, *(_build(factory, rest, options) for _ in range(num_envs - 1))]
    first.close()
    return [_build(factory, rest, {**options, "render_mode": "rgb_array"}) for _ in range(num_envs)]


def _is_aec(env: Any) -> bool:
    from pettingzoo import AECEnv

    return isinstance(env, AECEnv)


def _make_pz(rest: str, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0,
             **options: Any) -> PettingZooVecEnv:
    """A ParallelEnv's copies step together; an AEC env's copies take turns (PettingZooTurnsVecEnv)."""
    _require_pettingzoo(f"env 'pz:{rest}'")
    factory = _load_factory(rest)
    envs = _build_copies(factory, rest, options, num_envs)
    kind = PettingZooTurnsVecEnv if _is_aec(envs[0]) else PettingZooVecEnv
    return kind(rest, envs, device=device, seed=seed)


# Every `pz:` env's training defaults, after MAPPO's for MPE (Yu et al. 2022: value and input normalisation,
# lr 7e-4, entropy bonus 0.01), each for a cause measured on simple_spread (issue 51; docs/EXPERIMENTS.md,
# simple_spread). PettingZoo's returns run to tens (about -25 per agent an episode), and with the value loss in
# those units its gradient owned the clipped norm: grad norm 25 against max_grad_norm 0.5 cut every step 50-fold,
# approx KL 1e-6, and at 3M steps the team stood midway between random play and a hand-written heuristic. With
# values normalised and the entropy bonus alone it still played at random play's level at 1.2M steps (seed 1);
# MAPPO's input normalisation and lr 7e-4 with them (the two not measured apart) reached the table's figures.
# Without the entropy bonus the adapter's tic-tac-toe turned deterministic within 400k moves.
PZ_TRAIN_DEFAULTS = {"norm_value": True, "norm_obs": True, "lr": 7e-4, "ent_coef": 0.01}

register_prefix("pz", _make_pz, train_defaults=PZ_TRAIN_DEFAULTS)

__all__ = ["PettingZooTurnsVecEnv", "PettingZooVecEnv", "to_pettingzoo"]
