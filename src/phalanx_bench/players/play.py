"""Whole games of a PettingZoo AEC env between plain callables over its observation dicts, for the reference
players' checks and the bench: `play(env, {agent: player})` -> each agent's return.

A player gets the observation dict of its turn and returns an action; one that returns an action its
action_mask forbids ends the game with an error naming it (an illegal move is never played).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np

Player = Callable[[dict[str, Any]], int]


def random_player(seed: int | None = None) -> Player:
    """Uniform over the moves the mask allows."""
    rng = random.Random(seed)
    return lambda observation: rng.choice(np.flatnonzero(np.asarray(observation["action_mask"])).tolist())


def play(env: Any, players: dict[str, Player], seed: int | None = None) -> dict[str, float]:
    """One game from `env.reset(seed)`: -> each agent's total reward."""
    env.reset(seed=seed)
    returns = dict.fromkeys(env.possible_agents, 0.0)
    for agent in env.agent_iter():
        observation, reward, terminated, truncated, _ = env.last()
        returns[agent] += float(reward)
        if terminated or truncated:
            env.step(None)
            continue
        action = int(players[agent](observation))
        if not np.asarray(observation["action_mask"])[action]:
            raise ValueError(f"{agent} played {action}, which its action_mask forbids")
        env.step(action)
    return returns
