"""pz_turns' game with the action mask in the info dict (`infos[agent]["action_mask"]`), a convention some PettingZoo
envs use, instead of the observation dict: the agents observe the bare `observation` (`pz:pz_info_turns:make_env`).

`broken` breaks a rule as in pz_turns ("mask_shape", "mask_dtype", "mask_empty", "selection", "last"), or
"mask_missing": taker_1's info holds no action_mask.
"""

from __future__ import annotations

import numpy as np
from pz_turns import TAKES, TakeTurnsEnv

__all__ = ["TAKES", "InfoMaskTurnsEnv", "make_env"]


class InfoMaskTurnsEnv(TakeTurnsEnv):
    metadata = {"name": "pz_info_turns_v0", "render_modes": [], "is_parallelizable": False}

    def __init__(self, truncate_at: int = 0, broken: str = "") -> None:
        super().__init__(truncate_at=truncate_at, broken=broken)
        self.observation_spaces = {a: space["observation"] for a, space in self.observation_spaces.items()}

    def observe(self, agent: str) -> np.ndarray:
        return super().observe(agent)["observation"]

    def _set_infos(self) -> None:
        self.infos = {a: {} if self.broken == "mask_missing" and a == "taker_1" else {"action_mask": self._mask(a)}
                      for a in self.agents}

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        super().reset(seed=seed, options=options)
        self._set_infos()

    def step(self, action: int | None) -> None:
        super().step(action)
        self._set_infos()


def make_env(truncate_at: int = 0, broken: str = "") -> InfoMaskTurnsEnv:
    return InfoMaskTurnsEnv(truncate_at=truncate_at, broken=broken)

