"""Players written outside Phalanx that misbehave, for the outside-player tests (`--vs bad_bots:returns_text`)."""

from __future__ import annotations

import numpy as np

calls = {"n": 0}


def first_legal(obs):
    return int(np.flatnonzero(obs["action_mask"])[0])


def returns_text(obs):
    return str(first_legal(obs))


def returns_none(obs):
    return None


def returns_float(obs):
    return float(first_legal(obs))


def raises_later(obs):
    calls["n"] += 1
    if calls["n"] > 40:
        raise ValueError("the bot's table has no entry for this board")
    return first_legal(obs)
