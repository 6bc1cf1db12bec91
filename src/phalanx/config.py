"""The one typed config schema: every hyperparameter with its default and meaning.

Precedence when resolving: schema defaults < the env's own training defaults < a YAML/TOML file
< keyword / command-line overrides.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from phalanx.coerce import coerce
from phalanx.envs import registry
from phalanx.errors import ConfigError
from phalanx.model_kinds import KINDS, MLP, TRANSFORMER, ModelKind

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _f(default: Any, help: str, *, min: float | None = None, max: float | None = None, choices: tuple | None = None,
       positive: bool = False):
    meta = {"help": help, "min": min, "max": max, "choices": choices, "positive": positive}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


MAX_TOTAL_STEPS = 10**15  # beyond any run; a typo such as 1e99 is refused rather than trained on


@dataclass
class Config:
    """Every setting of a training run, each a typed key with its default, meaning and allowed values (the table
    below; `phalanx train --help`). `phalanx.train` resolves one from layers: these defaults < the env's own training
    defaults < a YAML or TOML file < keywords; a key it does not know, a value of the wrong type or out of range is
    refused in one line naming the key and what it allows."""

    # What to train on, where.
    env: str = _f("cartpole", "environment name (see `phalanx envs`)")
    env_options: dict = _f({}, "options passed to the environment (see `phalanx envs`)")
    total_steps: int = _f(200_000, "environment steps to train for (summed over envs; at least one batch, "
                          "num_envs * num_steps)", positive=True, max=MAX_TOTAL_STEPS)
    num_envs: int = _f(8, "parallel environments", positive=True)
    num_steps: int = _f(128, "rollout length per environment per update", positive=True)
    seed: int = _f(1, "random seed of the run (envs, sampling, minibatches)", min=0)
    device: str = _f("auto", "auto | cpu | cuda | cuda:N | mps ('auto' picks CUDA, then MPS, then CPU)")
    torch_threads: int = _f(0, "CPU threads for torch (0: chosen per phase from its work: on the CPU 1 where a call (a rollout step, a minibatch) is below 18.7M multiply-adds, the policy's parameters times its rows, else the CPUs this process may use, shared among torchrun's ranks on the node; torch's default on accelerators)", min=0)
    # PPO.
    lr: float = _f(2.5e-4, "Adam learning rate", positive=True)
    anneal_lr: bool = _f(True, "decay the learning rate linearly to 0 over the run")
    adam_eps: float = _f(1e-5, "Adam epsilon", positive=True)
    gamma: float = _f(0.99, "discount factor", min=0.0, max=1.0)
    gae_lambda: float = _f(0.95, "GAE lambda", min=0.0, max=1.0)
    num_epochs: int = _f(4, "passes over each rollout", positive=True)
    num_minibatches: int = _f(4, "minibatches per epoch", positive=True)
    update_chunks: int = _f(0, "forward and backward each minibatch in this many pieces, gradients summed before the "
                               "one optimizer step: the same update with a fraction of the activations in memory (0: "
                               "as many as the device's free memory needs, and on the CPU pieces of at most 128 MiB)",
                            min=0)
    clip_coef: float = _f(0.2, "PPO ratio clip", positive=True)
    clip_vloss: bool = _f(False, "clip the value loss around the old values (CleanRL's default; off as in Stable-Baselines3: "
                          "with returns in the hundreds it holds the critic back, docs/GUIDE.md)")
    vf_clip_coef: float = _f(0.0, "with clip_vloss: how far a value may move from the old one before its loss is clipped "
                             "(0: clip_coef; Stable-Baselines3's clip_range_vf)", min=0.0)
    vf_coef: float = _f(0.5, "value loss coefficient", min=0.0)
    ent_coef: float = _f(0.0, "entropy bonus coefficient", min=0.0)
    max_grad_norm: float = _f(0.5, "gradient norm clip", positive=True)
    target_kl: float = _f(0.0, "stop an update's epochs early above this approx-KL (0: off)", min=0.0)
    norm_adv: bool = _f(True, "normalise advantages per minibatch")
    norm_obs: bool = _f(False, "normalise observations by running mean/std (saved with checkpoints)")
    norm_reward: bool = _f(False, "scale rewards by the running std of the discounted return")
    norm_value: bool = _f(False, "learn values in running-normalised units (default on with critic=mappo)")
    obs_clip: float = _f(10.0, "clip normalised observations to +-this", positive=True)
    # Model.
    model: str = _f(MLP.name, "policy architecture (lstm / transformer: memory across an episode's steps; strategy: a "
                    "transformer over the opponent's recent steps feeding an LSTM, for two-sided games)",
                    choices=tuple(KINDS))
    hidden_sizes: list = _f([64, 64], "hidden layer widths of the actor and critic MLPs")
    activation: str = _f("tanh", "hidden activation", choices=("tanh", "relu", "gelu", "silu"))
    init_log_std: float = _f(0.0, "initial log-std of Gaussian action heads")
    relay_mass: float = _f(0.4, "model=role_attention: attention mass of the relay pool (the other roles share the rest; "
                           "1.0 goes to a lone pool)", min=0.0, max=1.0)
    relay_floor: float = _f(0.05, "model=role_attention: the least attention weight of every present relay", min=0.0,
                            max=1.0)
    attn_temperature: float = _f(1.0, "model=role_attention: softmax temperature of the neighbour attention", positive=True)
    cnn_channels: list = _f([32, 64, 64], "image policies: channels of the three conv layers (kernels 8, 4, 3; strides 4, 2, 1)")
    cnn_dense: int = _f(512, "image policies (model=cnn, or lstm / transformer on images): width of the dense layer "
                        "after the three conv layers", positive=True)
    board_channels: int = _f(32, "model=board: filters of its 3 x 3 conv layers", positive=True)
    board_blocks: int = _f(2, "model=board: residual blocks after the conv stem (two 3 x 3 convs each)", min=0)
    mirror: bool = _f(False, "model=board: average the policy and value over the board and its left-right reflection "
                      "(the env's mirror_actions), so that both are exactly symmetric")
    lookahead: bool = _f(False, "model=board: score each move by the net's reading of the board it makes (the env's "
                         "afterstates: deterministic board games), a one-move lookahead learned in self-play")
    exact_outcomes: bool = _f(False, "model=board: play a move that forces a win where there is one (the soonest), and "
                              "none that lets the other side force one where another move does not (the env's move outcomes: a "
                              "board game's own rules outcome_plies deep); the net chooses among the rest")
    outcome_plies: int = _f(2, "model=board with exact_outcomes: how many plies deep the game's outcomes are read "
                               "(2: a win at once, a reply that wins; 4: also the double threats either side can make)",
                            min=2, max=4)
    play_outcome_plies: int = _f(0, "model=board with exact_outcomes: how many plies deep the outcomes are read when the "
                                    "policy plays greedily (phalanx eval, export, packages, greedy opponents); 0: "
                                    "outcome_plies. Sampled moves (training's rollouts, snapshots) keep outcome_plies: "
                                    "the deeper horizon costs a decision, not a rollout", choices=(0, 2, 3, 4, 5, 6))
    play_rollouts: int = _f(0, "model=board with exact_outcomes: where the policy plays greedily (phalanx eval, packages, "
                               "greedy opponents), judge each move the net likes by this many games played on from it by "
                               "the policy itself, both sides sampling as in training, and play the best (on-line policy "
                               "improvement by Monte Carlo search); 0: the net's most likely move. Sampled moves "
                               "(training's rollouts, snapshots) never search; without exact_outcomes the key does nothing", min=0)
    play_solve_empties: int = _f(0, "model=board with exact_outcomes: where the policy plays greedily (phalanx eval, "
                                    "packages, greedy opponents), a position with at most this many empty cells is "
                                    "solved to the end of the game (the env's solver: connect four) and the policy plays "
                                    "only moves that keep its best outcome, the net and play_rollouts choosing among "
                                    "them; 0: never. Each empty cell more multiplies a search's time (24: milliseconds "
                                    "to about 2 s a position on one core); sampled moves never solve",
                                 min=0, max=30)
    lstm_hidden: int = _f(128, "LSTM width (model=lstm)", positive=True)
    tf_width: int = _f(64, "transformer width (model=transformer; also the strategy encoder and role attention)", positive=True)
    tf_layers: int = _f(2, "transformer layers", positive=True)
    tf_heads: int = _f(4, "transformer attention heads (must divide tf_width)", positive=True)
    tf_horizon: int = _f(32, "transformer KV-cache horizon: how many past steps of the episode a step attends to", positive=True)
    strategy_history: int = _f(90, "model=strategy: the opponent's past steps its encoder sees (split across tf_layers)",
                               positive=True)
    trial_bootstrap: str = _f("continue", "value across a trial end: continue (RL^2-style) or stop (cut like a termination)",
                              choices=("continue", "stop"))
    # Multi-agent.
    param_sharing: str = _f(
        "shared", "policy parameters: shared by all agents, shared with a one-hot agent id input, or one set per role",
        choices=("shared", "shared_id", "per_role"),
    )
    critic: str = _f("ippo", "ippo: critic reads the agent's observation; mappo: the env's global state plus the agent id",
                     choices=("ippo", "mappo"))
    mappo_values: str = _f(
        "per_agent", "with critic mappo: per_world values the state once per world with one output per agent (the "
        "default where the model allows: mlp and role_attention without per_role); per_agent once per agent with its "
        "one-hot id appended (the default elsewhere)",
        choices=("per_agent", "per_world"),
    )
    team_reward: float = _f(
        0.0, "mix each agent's learning reward with the team's mean reward: (1-w)*own + w*team (1: fully cooperative)",
        min=0.0, max=1.0,
    )
    teammates: str = _f(
        "", "comma list of policies for the last agent slots (scripted names from `phalanx envs`, or run:RUN_DIR for a "
        "frozen trained policy); the other slots learn"
    )
    # Self-play league (envs with two sides: the last num_agents // 2 slots are the opponent's).
    opponents: str = _f(
        "", "weighted opponent mix drawn per env at each episode reset, e.g. 'self_play:8,based:1.5,constant:0.5' "
        "(self_play: past snapshots; learner: the current policy; or a scripted name); empty: no league"
    )
    seats: str = _f("auto", "which side of a two-sided env the learner plays in a league: first (always the first "
                    "side), both (first in half of each env's episodes, second in the others, alternating), or auto (both "
                    "for turn-based games, whose first mover is the first side; first elsewhere)",
                    choices=("auto", "first", "both"))
    pool_sampling: str = _f("pfsp", "how self_play picks snapshots: uniform, latest, or pfsp (favour those the learner loses to)",
                            choices=("uniform", "latest", "pfsp"))
    pool_size: int = _f(8, "snapshots kept in the self-play pool (plus pinned ones)", positive=True)
    snapshot_every: int = _f(0, "snapshot the learner into the pool every this many steps (0: every 5% of the run)", min=0)
    pin_every: int = _f(0, "keep the snapshot taken after each multiple of this many steps forever (0: none)", min=0)
    nonfinite_env: str = _f("stop", "NaN / infinite values from the env: stop (the run ends with a snapshot) or zero (replace "
                            "with 0 and count them in env_nonfinite)", choices=("stop", "zero"))
    precision: str = _f("fp32", "bf16 runs the policy's forward passes under bfloat16 autocast (losses and optimizer stay "
                        "float32)", choices=("fp32", "bf16"))
    compile: bool = _f(False, "torch.compile the rollout step (whole where the env is capturable, else the policy's act) and the update step (first updates are slow)")
    cuda_graphs: bool = _f(False, "record the rollout step and the minibatch update step as CUDA graphs and replay them "
                                  "(CUDA only; an env that declares capturable; no torchrun)")
    # Run.
    run_dir: str = _f("", "run directory (default: runs/<env>-<time>-<6 random hex digits>)")
    checkpoint_every: int = _f(0, "write a checkpoint every this many steps (0: every 10% of the run)", min=0)
    checkpoint_minutes: float = _f(5.0, "also write a checkpoint when this many minutes passed since the last one, so a "
                                        "long run stopped early has one to resume (0: off)", min=0.0)
    keep_checkpoints: int = _f(3, "how many recent checkpoints to keep", positive=True)
    eval_episodes: int = _f(0, "greedy evaluation episodes at the end of training (0: none)", min=0)
    progress: bool = _f(True, "show a live progress bar")
    tensorboard: bool = _f(True, "write TensorBoard event files")
    wandb: bool = _f(False, "also log every update's metrics to Weights & Biases (the `wandb` extra)")
    wandb_project: str = _f("phalanx", "W&B project")
    wandb_mode: str = _f("online", "W&B mode: offline keeps the run on disk (`wandb sync` uploads it later)",
                         choices=("online", "offline"))

    @property
    def batch_size(self) -> int:
        """Environment steps of one update: num_envs * num_steps."""
        return self.num_envs * self.num_steps

    def to_dict(self) -> dict[str, Any]:
        """Every key and its value (what a run's config.json holds)."""
        return dataclasses.asdict(self)


P = TypeVar("P")


def params_of(cls: type[P], cfg: Config) -> P:
    """The frozen settings object `cls` (algo's StepParams, UpdateParams and GAEParams, RolloutParams, LeagueParams)
    filled from the config keys its fields are named after, so that a setting is listed once, in the schema
    (tests/test_structure.py checks that every field has its key)."""
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_HINTS = typing.get_type_hints(Config)


def default(key: str) -> Any:
    """The schema's default of config key `key`, a list as a tuple: what a model's constructor defaults to where it
    takes a key's value (one source of each default; models/registry.py passes the run's values)."""
    f = FIELDS[key]
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return tuple(value) if isinstance(value, list) else value


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """(key, type name, default, help) for every config key; the help lists a key's allowed values."""
    out = []
    for f in dataclasses.fields(Config):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        choices = f.metadata["choices"]
        help_ = f.metadata["help"] + (f" (one of {', '.join(map(str, choices))})" if choices else "")
        if f.metadata["max"] is not None and f.metadata["min"] is not None:
            help_ += f" (in [{f.metadata['min']:g}, {f.metadata['max']:g}])"
        out.append((f.name, _HINTS[f.name].__name__, default, help_))
    return out


def _coerce(key: str, value: Any) -> Any:
    return coerce(value, _HINTS[key], f"config key '{key}'")


def _check_range(key: str, value: Any) -> None:
    meta = FIELDS[key].metadata
    if meta["positive"] and value <= 0:
        raise ConfigError(f"config key '{key}' must be > 0, got {value!r}")
    if meta["min"] is not None and value < meta["min"]:
        bounds = f"in [{meta['min']}, {meta['max']}]" if meta["max"] is not None else f">= {meta['min']}"
        raise ConfigError(f"config key '{key}' must be {bounds}, got {value!r}")
    if meta["max"] is not None and value > meta["max"]:
        bounds = f"in [{meta['min']}, {meta['max']}]" if meta["min"] is not None else f"<= {meta['max']:g}"
        raise ConfigError(f"config key '{key}' must be {bounds}, got {value!r}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"config key '{key}' must be one of {', '.join(map(str, meta['choices']))}; got {value!r}")


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading numbers as YAML 1.2 does: under YAML 1.1 an unquoted `3e-4` or `1e6` (no
    dot, or no sign in the exponent) is text, which a typed key would refuse; here it is a float."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


class FileLayer(dict):
    """A config file's keys: typed values (YAML, TOML, JSON), so `resolve` holds each to its key's type where
    the command line's text is parsed; `path` names the file in a refusal."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        super().__init__(data)
        self.path = path


def load_file(path: str | Path) -> FileLayer:
    """Read a YAML or TOML (or JSON) config file into a mapping of typed values."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist" if not p.exists() else f"config file '{p}' is not a file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{p}' is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file '{p}' cannot be read: {e.strerror or e}") from None
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_YamlLoader) or {}
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file '{p}' must end in .yaml, .yml, .toml or .json")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any parser error becomes one line naming the file
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config file '{p}' is not valid: {msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of config keys")
    return FileLayer(data, p)


def _kind(name: Any) -> ModelKind:
    """The model kind a config layer names (an unknown name is refused later, with the other keys' checks)."""
    return KINDS.get(name, ModelKind("", "")) if isinstance(name, str) else ModelKind("", "")


def derive(given: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """The keys that follow from others where neither a layer nor the env's defaults set them, each with its
    reason: {key: (value, why)}. `resolve` applies them and `sources` labels them from this one function."""
    if given.get("critic") != "mappo":
        return {}
    out: dict[str, tuple[Any, str]] = {}
    if "norm_value" not in given:
        out["norm_value"] = (True, "critic mappo")
    model = given.get("model", Config.model)
    if ("mappo_values" not in given and _kind(model).world_values
            and given.get("param_sharing", Config.param_sharing) != "per_role"):
        # As fast or faster per pass and learns as well (docs/GUIDE.md, mappo_values).
        out["mappo_values"] = ("per_world", f"critic mappo, model {model}")
    return out


def parse_text_layer(layer: dict[str, Any]) -> dict[str, Any]:
    """The command line's keys, their text read as each key's type (`--num-envs 8`, `--anneal-lr no`): what `resolve`
    takes, as it takes a file's or a Python caller's typed values."""
    out = {}
    for key, value in layer.items():
        key = key.replace("-", "_")
        if key not in FIELDS:
            raise ConfigError(f"unknown config key {key!r}; see `phalanx train --help` for the keys")
        out[key] = value if key == "env_options" else _coerce(key, value)
    return out


def resolve(*layers: dict[str, Any] | None) -> Config:
    """Merge override mappings (later wins) over the defaults, validating every key. Every value must have its key's
    type, as a file's and a Python caller's do (`phalanx.train(num_envs="8")` is refused as a file's "8" is); the
    command line's text is read first (`parse_text_layer`). A `FileLayer` names its file in a refusal."""
    merged: dict[str, Any] = {}
    env_opts: dict[str, Any] = {}
    typed_env_opts: list[tuple[dict[str, Any], str]] = []
    for layer in layers:
        where = f" in '{layer.path}'" if isinstance(layer, FileLayer) else ""
        for key, value in (layer or {}).items():
            key = key.replace("-", "_")
            if key not in FIELDS:
                raise ConfigError(f"unknown config key {key!r}; see `phalanx train --help` for the keys")
            value = coerce(value, _HINTS[key], f"config key '{key}'{where}", parse_text=False)
            if key == "env_options":
                env_opts.update(_coerce(key, value))
                typed_env_opts.append((value, where))
            else:
                merged[key] = value
    env = merged.get("env", Config.env)
    if not isinstance(env, str):
        raise ConfigError(f"config key 'env' must be str, got {env!r}")
    registry.check_name(env)
    types = registry.option_types(env) if typed_env_opts else {}
    for opts, where in typed_env_opts:  # typed where the env declares the type; the registry refuses unknown ones
        for key, value in opts.items():
            if key in types:
                coerce(value, types[key], f"env option '{key}' of '{env}'{where}", parse_text=False)
    base = registry.train_defaults(env)
    env_opts = {**base.pop("env_options", {}), **env_opts}
    if "model" in base and merged.get("model", base["model"]) != base["model"]:
        for key in KINDS[base["model"]].keys:
            base.pop(key, None)
    base.update(merged)
    base.update({key: value for key, (value, _) in derive(base).items()})
    values = {}
    for key, value in base.items():
        value = _coerce(key, value)
        if not isinstance(value, (list, dict)):
            _check_range(key, value)
        values[key] = value
    values["env_options"] = registry.resolve_options(env, env_opts)
    cfg = Config(**values)
    # A memory model's update replays each env's rollout as one sequence, so a minibatch holds whole envs.
    if KINDS[cfg.model].recurrent and cfg.num_minibatches > cfg.num_envs:
        raise ConfigError(
            f"config key 'num_minibatches' must be <= num_envs ({cfg.num_envs}) with model={cfg.model}: minibatches keep each "
            f"env's segment whole; got {cfg.num_minibatches}"
        )
    if cfg.model == TRANSFORMER.name and cfg.tf_width % cfg.tf_heads:
        raise ConfigError(f"config key 'tf_heads' must divide tf_width ({cfg.tf_width}); got {cfg.tf_heads}")
    if cfg.total_steps < cfg.batch_size:
        raise ConfigError(f"config key 'total_steps' must be at least one batch, num_envs * num_steps = {cfg.batch_size:,}; "
                          f"got {cfg.total_steps:,}")
    if cfg.num_minibatches > cfg.batch_size:
        raise ConfigError(
            f"config key 'num_minibatches' must be <= num_envs * num_steps ({cfg.batch_size}), got {cfg.num_minibatches}"
        )
    return cfg


def sources(cfg: Config, file_layer: dict[str, Any] | None = None, cli_layer: dict[str, Any] | None = None) -> dict[str, str]:
    """Where each key of a resolved config came from: 'command line', 'file', "env '<name>' defaults",
    'derived (<why>)' (from `derive`, as `resolve` derived it) or 'schema'. The layers are `resolve`'s: the
    file's, then the command line's (keys with '-' or '_')."""
    norm = lambda layer: {k.replace("-", "_") for k in (layer or {})}  # noqa: E731
    cli, file = norm(cli_layer), norm(file_layer)
    env_defaults = set(registry.train_defaults(cfg.env))
    derived = derive({key: getattr(cfg, key) for key in cli | file | env_defaults if key in FIELDS})
    out = {}
    for key in FIELDS:
        if key in cli:
            out[key] = "command line"
        elif key in file:
            out[key] = "file"
        elif key in env_defaults:
            out[key] = f"env '{cfg.env}' defaults"
        elif key in derived:
            out[key] = f"derived ({derived[key][1]})"
        else:
            out[key] = "schema"
    return out


def effective_defaults(env: str) -> dict[str, Any]:
    """The defaults a run on `env` starts from: the schema's under the env's own training defaults."""
    registry.check_name(env)
    return {**{k: v for k, _, v, _ in describe_keys()}, **registry.train_defaults(env)}


def from_json(data: dict[str, Any]) -> Config:
    return resolve(data)

