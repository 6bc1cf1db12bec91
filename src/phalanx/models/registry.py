"""Model name -> builder, with the capabilities it declares (mirrors envs/registry.py).

`check_model` raises every `ConfigError` a model would (before the trainer touches the run directory
or any random state); `build_model` checks, then builds. The names and what each model is are model_kinds.py's;
every kind has its builder here (a test keeps them equal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from phalanx.config import Config
from phalanx.envs.base import VecEnv
from phalanx.envs.spaces import Discrete
from phalanx.errors import ConfigError
from phalanx.model_kinds import BOARD, CNN, KINDS, LSTM, MLP, ROLE_ATTENTION, STRATEGY, TRANSFORMER, ModelKind
from phalanx.models.board import BoardActorCritic
from phalanx.models.cnn import CNNActorCritic, CNNMemoryActorCritic
from phalanx.models.memory import LSTMActorCritic, MemorySettings, TransformerActorCritic
from phalanx.models.mlp import MLPActorCritic
from phalanx.models.protocol import ActorCritic
from phalanx.models.role_attention import RoleAttentionActorCritic
from phalanx.models.strategy import StrategyActorCritic


def obs_dim_of(env: VecEnv) -> int:
    return int(math.prod(env.observation_space.shape))


def state_dim_of(env: VecEnv) -> int | None:
    return int(math.prod(env.state_space.shape)) if env.state_space is not None else None


def is_image_env(env: VecEnv) -> bool:
    return len(env.observation_space.shape) == 3


@dataclass(frozen=True)
class ModelSpec:
    kind: ModelKind
    build: Callable[[Config, VecEnv], ActorCritic]
    # Refuses configs the model cannot serve, naming the key; runs before anything is built.
    check: Callable[[Config, VecEnv], None]

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def description(self) -> str:
        return self.kind.description

    @property
    def recurrent(self) -> bool:
        return self.kind.recurrent


MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    MODELS[spec.name] = spec


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ConfigError(f"config key 'model' must be one of {', '.join(MODELS)}; got {name!r}")
    return MODELS[name]


def check_model(cfg: Config, env: VecEnv) -> None:
    """Every ConfigError building `cfg.model` for `env` would raise, without building it."""
    if cfg.critic == "mappo" and env.state_space is None:
        raise ConfigError(f"config key 'critic' is 'mappo' but env '{cfg.env}' has no global state; use ippo")
    if cfg.mappo_values == "per_world":
        if cfg.critic != "mappo":
            raise ConfigError(f"config key 'mappo_values' is per_world, which needs critic mappo; got critic {cfg.critic}")
        if not KINDS[cfg.model].world_values or cfg.param_sharing == "per_role":
            able = " or ".join(k.name for k in KINDS.values() if k.world_values)
            raise ConfigError(f"config key 'mappo_values' is per_world, which needs model {able} without "
                              f"param_sharing per_role; got model {cfg.model}, param_sharing {cfg.param_sharing}")
    space = env.action_space
    if isinstance(space, Discrete) and space.slot_n:
        if not KINDS[cfg.model].slot_actions:
            able = ", ".join(k.name for k in KINDS.values() if k.slot_actions)
            raise ConfigError(f"config key 'model' must be one of {able} for env '{cfg.env}', whose slots "
                              f"have different numbers of actions ({list(space.slot_n)}); got {cfg.model}")
        if cfg.teammates or cfg.opponents:
            raise ConfigError(f"config keys 'teammates' / 'opponents' are not supported with env '{cfg.env}', whose slots "
                              "have different numbers of actions")
    if cfg.model != BOARD.name and (cfg.mirror or cfg.lookahead or cfg.exact_outcomes):
        key = "mirror" if cfg.mirror else "lookahead" if cfg.lookahead else "exact_outcomes"
        raise ConfigError(f"config key '{key}' is true but applies only to model=board; got model {cfg.model} (set "
                          f"--model board, or {key} false)")
    model_spec(cfg.model).check(cfg, env)


def build_model(cfg: Config, env: VecEnv) -> ActorCritic:
    check_model(cfg, env)
    return MODELS[cfg.model].build(cfg, env)


def _roles(cfg: Config, env: VecEnv) -> torch.Tensor | None:
    return env.roles.detach().cpu() if cfg.param_sharing == "per_role" else None


def _state_dim(cfg: Config, env: VecEnv) -> int | None:
    return state_dim_of(env) if cfg.critic == "mappo" else None


# -- mlp -------------------------------------------------------------------------------------------
def _no_check(cfg: Config, env: VecEnv) -> None:
    pass


def _build_mlp(cfg: Config, env: VecEnv) -> ActorCritic:
    return MLPActorCritic(
        obs_dim_of(env), env.action_space, tuple(cfg.hidden_sizes), cfg.activation,
        num_agents=env.num_agents, agent_id=cfg.param_sharing == "shared_id", roles=_roles(cfg, env),
        state_dim=_state_dim(cfg, env), init_log_std=cfg.init_log_std, world_value=cfg.mappo_values == "per_world",
    )


# -- cnn (and the memory models on images) ---------------------------------------------------------
def _check_image(cfg: Config, env: VecEnv) -> None:
    if not is_image_env(env):
        raise ConfigError(f"config key 'model' is cnn but env '{cfg.env}' has flat observations "
                          f"{tuple(env.observation_space.shape)}; allowed for it: {MLP.name}, {LSTM.name}, {TRANSFORMER.name}")
    if cfg.critic == "mappo" or cfg.param_sharing == "per_role":
        raise ConfigError("image policies use a per-agent critic and shared parameters: set critic ippo, param_sharing shared or shared_id")
    if cfg.norm_obs:
        raise ConfigError("config key 'norm_obs' must be false for image observations (the CNN scales pixels itself)")
    if cfg.model == CNN.name and len(cfg.cnn_channels) != 3:
        raise ConfigError(f"config key 'cnn_channels' needs 3 widths (one per conv layer), got {cfg.cnn_channels}")


def _build_cnn(cfg: Config, env: VecEnv) -> ActorCritic:
    shape = tuple(env.observation_space.shape)
    high = float(env.observation_space.high_tensor("cpu").max())
    common = dict(num_agents=env.num_agents, agent_id=cfg.param_sharing == "shared_id", init_log_std=cfg.init_log_std)
    if cfg.model == CNN.name:
        return CNNActorCritic(shape, env.action_space, channels=tuple(cfg.cnn_channels), out_dim=cfg.cnn_dense,
                              hidden_sizes=(), max_value=high, **common)
    core = dict(hidden=cfg.lstm_hidden) if cfg.model == LSTM.name else dict(width=cfg.tf_width, layers=cfg.tf_layers,
                                                                           heads=cfg.tf_heads, horizon=cfg.tf_horizon)
    return CNNMemoryActorCritic(shape, env.action_space, core=cfg.model, channels=tuple(cfg.cnn_channels),
                                out_dim=cfg.cnn_dense, max_value=high, critic_hidden=tuple(cfg.hidden_sizes), **core, **common)


# -- role attention --------------------------------------------------------------------------------
def _check_role_attention(cfg: Config, env: VecEnv) -> None:
    if cfg.param_sharing == "per_role":
        raise ConfigError("config key 'param_sharing' cannot be per_role with model=role_attention (roles enter as "
                          "embeddings); use shared or shared_id")
    if cfg.relay_mass > 1.0:
        raise ConfigError(f"config key 'relay_mass' must be in [0, 1], got {cfg.relay_mass}")


def _build_role_attention(cfg: Config, env: VecEnv) -> ActorCritic:
    relays = tuple(i for i, n in enumerate(env.role_names) if n == "relay")
    return RoleAttentionActorCritic(
        obs_dim_of(env), env.action_space, env.roles.detach().cpu(), len(env.role_names), relay_roles=relays,
        width=cfg.tf_width, heads=cfg.tf_heads, hidden_sizes=tuple(cfg.hidden_sizes), activation=cfg.activation,
        agent_id=cfg.param_sharing == "shared_id", state_dim=_state_dim(cfg, env), init_log_std=cfg.init_log_std,
        masses=(1.0 - cfg.relay_mass, cfg.relay_mass), relay_floor=cfg.relay_floor, temperature=cfg.attn_temperature,
        world_value=cfg.mappo_values == "per_world",
    )


# -- memory models ---------------------------------------------------------------------------------
def _check_memory(cfg: Config, env: VecEnv) -> None:
    if is_image_env(env) and cfg.model != STRATEGY.name:  # on images: the CNN encoder, then the memory core
        _check_image(cfg, env)
    if cfg.param_sharing == "per_role":
        raise ConfigError(f"config key 'param_sharing' cannot be per_role with model={cfg.model}; use shared or shared_id")


def _memory_settings(cfg: Config, env: VecEnv) -> MemorySettings:
    """What the three memory models share, from the config and the env (their cores' sizes are their own)."""
    return MemorySettings(obs_dim_of(env), env.action_space, num_agents=env.num_agents,
                          agent_id=cfg.param_sharing == "shared_id", state_dim=_state_dim(cfg, env),
                          init_log_std=cfg.init_log_std, critic_hidden=tuple(cfg.hidden_sizes))


def _build_lstm(cfg: Config, env: VecEnv) -> ActorCritic:
    if is_image_env(env):
        return _build_cnn(cfg, env)
    return LSTMActorCritic(_memory_settings(cfg, env), hidden=cfg.lstm_hidden, activation=cfg.activation)


def _build_transformer(cfg: Config, env: VecEnv) -> ActorCritic:
    if is_image_env(env):
        return _build_cnn(cfg, env)
    # The blocks keep the model's GELU: `activation` is not read here.
    return TransformerActorCritic(_memory_settings(cfg, env), width=cfg.tf_width, layers=cfg.tf_layers,
                                  heads=cfg.tf_heads, horizon=cfg.tf_horizon)


def _build_strategy(cfg: Config, env: VecEnv) -> ActorCritic:
    # Each layer attends `horizon` steps back, so the layers together see strategy_history steps.
    horizon = -(-cfg.strategy_history // cfg.tf_layers)
    return StrategyActorCritic(_memory_settings(cfg, env), hidden=cfg.lstm_hidden, width=cfg.tf_width,
                               layers=cfg.tf_layers, heads=cfg.tf_heads, history=horizon, activation=cfg.activation)


# -- board -----------------------------------------------------------------------------------------
def _check_board(cfg: Config, env: VecEnv) -> None:
    if not is_image_env(env):
        raise ConfigError(f"config key 'model' is board but env '{cfg.env}' has flat observations "
                          f"{tuple(env.observation_space.shape)}; it takes boards [rows, cols, planes]")
    if cfg.critic == "mappo" or cfg.param_sharing == "per_role":
        raise ConfigError("model=board uses a per-agent critic and shared parameters: set critic ippo, param_sharing "
                          "shared or shared_id")
    if cfg.norm_obs:
        raise ConfigError("config key 'norm_obs' must be false with model=board (its planes are 0 / 1)")
    if cfg.lookahead and not env.has_afterstates:
        raise ConfigError(f"config key 'lookahead' is true but env '{cfg.env}' has no afterstates (a deterministic board "
                          "game's move function); allowed for it: false")
    if cfg.exact_outcomes and not env.has_move_outcomes:
        raise ConfigError(f"config key 'exact_outcomes' is true but env '{cfg.env}' has no move outcomes (a board game's "
                          "win rule read off its boards); allowed for it: false")
    if cfg.play_rollouts and not env.has_afterstates:
        raise ConfigError(f"config key 'play_rollouts' is {cfg.play_rollouts} but env '{cfg.env}' has no afterstates (a "
                          "deterministic board game's move function) to play games on with; allowed for it: 0")
    if cfg.play_solve_empties and not env.has_solved_outcomes:
        raise ConfigError(f"config key 'play_solve_empties' is {cfg.play_solve_empties} but env '{cfg.env}' has no "
                          "solver (a board game's outcomes under perfect play to its end); allowed for it: 0")
    if cfg.mirror and env.mirror_actions is None:
        raise ConfigError(f"config key 'mirror' is true but env '{cfg.env}' declares no mirror_actions (no left-right "
                          "symmetry); allowed for it: false")


def _build_board(cfg: Config, env: VecEnv) -> ActorCritic:
    return BoardActorCritic(tuple(env.observation_space.shape), env.action_space, channels=cfg.board_channels,
                            blocks=cfg.board_blocks, num_agents=env.num_agents, agent_id=cfg.param_sharing == "shared_id",
                            mirror_actions=env.mirror_actions if cfg.mirror else None,
                            afterstates=env.afterstate_fn() if cfg.lookahead else None,
                            move_outcomes=env.move_outcome_fn(cfg.outcome_plies) if cfg.exact_outcomes else None,
                            play_outcomes=env.move_outcome_fn(cfg.play_outcome_plies)
                            if cfg.exact_outcomes and cfg.play_outcome_plies not in (0, cfg.outcome_plies) else None,
                            successors=env.afterstate_fn() if cfg.play_rollouts and cfg.exact_outcomes else None,
                            play_rollouts=cfg.play_rollouts if cfg.exact_outcomes else 0,
                            play_solved=env.solved_outcome_fn(cfg.play_solve_empties)
                            if cfg.exact_outcomes and cfg.play_solve_empties else None,
                            init_log_std=cfg.init_log_std)


register_model(ModelSpec(MLP, _build_mlp, _no_check))
register_model(ModelSpec(LSTM, _build_lstm, _check_memory))
register_model(ModelSpec(TRANSFORMER, _build_transformer, _check_memory))
register_model(ModelSpec(STRATEGY, _build_strategy, _check_memory))
register_model(ModelSpec(CNN, _build_cnn, _check_image))
register_model(ModelSpec(ROLE_ATTENTION, _build_role_attention, _check_role_attention))
register_model(ModelSpec(BOARD, _build_board, _check_board))
