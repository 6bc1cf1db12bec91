"""The model names (the config's `model` values) and what each model is, declared once: config.py checks a config
against them, models/registry.py gives each its builder (tests/test_structure.py keeps the names here alone)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelKind:
    name: str
    description: str
    # A memory model: rollouts carry a state and minibatches keep each env's segment whole.
    recurrent: bool = False
    # Its MAPPO critic can value a world's state once, with one output per slot (`mappo_values: per_world`).
    world_values: bool = False
    # Serves envs whose slots have different numbers of discrete actions.
    slot_actions: bool = False
    # The config keys only this model reads: an env's training defaults for them hold only where a run keeps the env's
    # default model (`--model mlp` on connect four drops its board keys rather than refusing them).
    keys: tuple[str, ...] = ()


MLP = ModelKind("mlp", "separate actor and critic MLPs (shared, slot id or per-role parameters)", world_values=True,
                slot_actions=True)
LSTM = ModelKind("lstm", "an LSTM over the episode's steps (on images: after the CNN encoder)", recurrent=True)
TRANSFORMER = ModelKind("transformer", "a causal transformer with a KV cache of tf_horizon steps (on images: after the CNN)",
                        recurrent=True)
STRATEGY = ModelKind("strategy", "a transformer over the opponent's recent steps feeding an LSTM (two-sided games)",
                     recurrent=True)
CNN = ModelKind("cnn", "Nature-CNN encoder and dense layer for pixel observations", slot_actions=True)
ROLE_ATTENTION = ModelKind("role_attention", "attention over the other slots, pooled per role (heterogeneous teams)",
                           world_values=True, slot_actions=True)

BOARD = ModelKind("board", "residual conv net over a board's planes, optionally mirror-symmetric (board games)",
                  keys=("board_channels", "board_blocks", "mirror", "lookahead", "exact_outcomes", "outcome_plies",
                        "play_outcome_plies", "play_rollouts", "play_solve_empties"))

KINDS: dict[str, ModelKind] = {k.name: k for k in (MLP, LSTM, TRANSFORMER, STRATEGY, CNN, ROLE_ATTENTION, BOARD)}
