"""Name -> environment factory, with declared options and per-env training defaults.

An env is named in one of four ways: a registered name (`cartpole`, or `vmas:navigation`: a registered name wins over
its prefix); a prefix name (`gym:<id>`,
`pz:<module>:<fn>`); a plugin `package.module:attr`, imported on first use (from the current directory
too, as `python -m` would), whose `attr` is an `EnvSpec` or a factory; or the name of an entry point in
the `phalanx.envs` group of an installed package. The run directory keeps the name, so evaluation,
resume and recordings make the env again the same way. The built-in envs and prefixes (phalanx.zoo,
phalanx.envs.adapters) are named in a table here and their modules imported on first use (`BUILT_IN`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from phalanx.coerce import coerce
from phalanx.envs.base import VecEnv
from phalanx.errors import ConfigError, PhalanxError, one_line


@dataclass(frozen=True)
class EnvOption:
    """One option of a registered env (`make(name, **options)`, `--env-options`): its default, meaning and allowed
    values, checked before the env is built."""

    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    min: float | None = None  # the least allowed value (numbers)
    max: float | None = None  # the largest allowed value (numbers)
    # A curriculum for training (a random opening, a shaping term): evaluations leave it at its default unless
    # `phalanx eval` is given it, so a score is measured on the env itself (`evaluation_options`).
    train_only: bool = False


@dataclass(frozen=True)
class EnvSpec:
    """What `register` records of an env name: the factory that builds it, its options, and the training defaults
    that suit it (between the schema's defaults and the user's config)."""

    name: str
    factory: Callable[..., VecEnv]
    description: str
    options: dict[str, EnvOption] = field(default_factory=dict)
    # Training defaults that suit this env (merged over the schema defaults, under user config).
    train_defaults: dict[str, Any] = field(default_factory=dict)
    # No declared options: any keyword the factory's signature takes passes through (plugin factories).
    free_options: bool = False
    # A plugin's import root (the sys.path entry its module came from), kept in the run's manifest so
    # that eval and resume import it again from anywhere.
    source: str | None = None
    # The gymnasium env this one reproduces step for step (CartPole-v1): a package card's dataset, and the env
    # examples/onnx_play/play.py plays the exported graph in. None where there is none.
    gymnasium_id: str | None = None
    # What else it reproduces, in words (PettingZoo's tictactoe_v3, rules and observations): the card says so.
    reproduces: str | None = None


_REGISTRY: dict[str, EnvSpec] = {}
_PREFIX_FACTORIES: dict[str, Callable[..., VecEnv]] = {}
_PREFIX_DEFAULTS: dict[str, dict[str, Any]] = {}

# The built-in names and prefixes, each with the module whose import registers it. This table is data
# the registry needs, not a way round an import: it is how `make("cartpole")`, `phalanx envs` and the
# "allowed: ..." of an unknown-env error know the built-in names while none of their modules is
# imported. Those modules (the zoo and the adapters, a third of the library's lines) are imported the
# first time one of their names is asked for: reading the config schema imports none of them, making
# one env imports that env's module only, and `registered()` imports them all. The order is the one
# `registered()` lists them in (that of the package's old eager imports). tests/test_structure.py
# checks the table against what the modules register.
BUILT_IN: dict[str, str] = {
    "bucket_brigade": "phalanx.zoo.bucket_brigade",
    "cartpole": "phalanx.zoo.cartpole",
    "drone_swarm": "phalanx.zoo.drone_swarm",
    "duel": "phalanx.zoo.duel",
    "pendulum": "phalanx.zoo.pendulum",
    "pixel_goal": "phalanx.zoo.pixel_goal",
    "trial_nav": "phalanx.zoo.trial_nav",
    "tictactoe": "phalanx.zoo.board_games",
    "connect_four": "phalanx.zoo.board_games",
    "vmas:navigation": "phalanx.envs.adapters.vmas",
    "vmas:balance": "phalanx.envs.adapters.vmas",
    "vmas:dispersion": "phalanx.envs.adapters.vmas",
    "vmas:passage": "phalanx.envs.adapters.vmas",
    "vmas:transport": "phalanx.envs.adapters.vmas",
    "vmas:wheel": "phalanx.envs.adapters.vmas",
    "gym:LunarLander-v3": "phalanx.envs.adapters.gym",
    "gym:Pendulum-v1": "phalanx.envs.adapters.gym",
    "gym:HalfCheetah-v5": "phalanx.envs.adapters.gym",
    "gym:Hopper-v5": "phalanx.envs.adapters.gym",
    "gym:Walker2d-v5": "phalanx.envs.adapters.gym",
}
BUILT_IN_PREFIXES: dict[str, str] = {
    "gym": "phalanx.envs.adapters.gym",
    "pz": "phalanx.envs.adapters.pettingzoo",
    "vmas": "phalanx.envs.adapters.vmas",
}
# What the built-in modules registered when imported, kept apart from the two tables above: a module
# registers once, on its first import, so a name is put back from here where `_REGISTRY` was replaced
# since (tests swap in a copy for the length of a test).
_BUILT_IN_SPECS: dict[str, EnvSpec] = {}
_BUILT_IN_FACTORIES: dict[str, Callable[..., VecEnv]] = {}


def _own(table: dict[str, str], key: str, obj: Any) -> bool:
    """Whether `obj` (a factory) is the built-in one for `key`: it comes from the module the table names."""
    return table.get(key) is not None and getattr(obj, "__module__", None) == table[key]


def register(spec: EnvSpec) -> None:
    """Make `spec.name` an env name that `make`, the config and the command line accept (replacing a built-in env of
    that name, whose module is imported first so that its own registration cannot win later)."""
    if _own(BUILT_IN, spec.name, spec.factory):
        _BUILT_IN_SPECS[spec.name] = spec
    elif spec.name in BUILT_IN:  # replacing a built-in env: its module first, so that its import cannot win later
        _load(spec.name)
    _REGISTRY[spec.name] = spec


def register_prefix(prefix: str, factory: Callable[..., VecEnv], train_defaults: dict[str, Any] | None = None) -> None:
    """`prefix:<rest>` names are built by `factory(rest, num_envs=, device=, seed=, **options)`; `train_defaults`:
    the training defaults of every such name (merged over the schema defaults, under user config), unless the name
    is registered with its own spec (a tuned `gym:` task)."""
    _PREFIX_DEFAULTS[prefix] = dict(train_defaults or {})
    if _own(BUILT_IN_PREFIXES, prefix, factory):
        _BUILT_IN_FACTORIES[prefix] = factory
    elif prefix in BUILT_IN_PREFIXES:
        _load_prefix(prefix)
    _PREFIX_FACTORIES[prefix] = factory


def _ensure(key: str, table: dict[str, str], kept: dict[str, Any], live: dict[str, Any]) -> None:
    """Make the built-in `key` of `table` registered in `live`: import its module on first use (the import
    registers it, and `register` keeps it in `kept`), or put it back from `kept` where `live` lost it."""
    if key in live or key not in table:
        return
    if key not in kept:
        importlib.import_module(table[key])
    if key in kept:
        live.setdefault(key, kept[key])


def _load(name: str) -> None:
    """A built-in env name registered (`cartpole`, `vmas:navigation`); any other name: nothing done."""
    _ensure(name, BUILT_IN, _BUILT_IN_SPECS, _REGISTRY)


def _load_prefix(prefix: str) -> None:
    """A built-in prefix (`gym`, `pz`, `vmas`) registered; any other: nothing done."""
    _ensure(prefix, BUILT_IN_PREFIXES, _BUILT_IN_FACTORIES, _PREFIX_FACTORIES)


def _prefixes() -> set[str]:
    return {*_PREFIX_FACTORIES, *BUILT_IN_PREFIXES}


def registered() -> dict[str, EnvSpec]:
    """Every registered env, the built-in ones included (importing their modules)."""
    for name in BUILT_IN:
        _load(name)
    for prefix in BUILT_IN_PREFIXES:
        _load_prefix(prefix)
    return dict(_REGISTRY)


ENTRY_POINT_GROUP = "phalanx.envs"


def spec(name: str) -> EnvSpec | None:
    """The spec of a registered, plugin or entry-point env (loading it on first use); None for an
    unknown name and for prefix names (`gym:...`), whose options the adapter checks."""
    _load(name)
    if name in _REGISTRY:
        return _REGISTRY[name]
    found = _plugin(name) if ":" in name else _entry_point(name)
    if found is not None:
        _REGISTRY[name] = found
    return found


def gymnasium_id(name: str) -> str | None:
    """The gymnasium env id env `name` is (`gym:ID`) or reproduces step for step (`EnvSpec.gymnasium_id`); else None."""
    if name.startswith("gym:"):
        return name.removeprefix("gym:")
    found = spec(name)
    return found.gymnasium_id if found is not None else None


def train_defaults(name: str) -> dict[str, Any]:
    """The training defaults of env `name`: its spec's, else its prefix's (`pz:...`), else none."""
    s = spec(name)
    if s is not None:
        return dict(s.train_defaults)
    if is_prefix_name(name):
        prefix = name.split(":", 1)[0]
        _load_prefix(prefix)
        return dict(_PREFIX_DEFAULTS.get(prefix, {}))
    return {}


def is_prefix_name(name: str) -> bool:
    return name.split(":", 1)[0] in _prefixes() and ":" in name


def known_names() -> list[str]:
    """What an unknown-env error lists."""
    points = sorted(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    # Plugins loaded so far and registered `prefix:<id>` names are covered by the last two forms.
    plain = sorted(n for n in {*_REGISTRY, *BUILT_IN} if ":" not in n)
    return plain + points + [f"{p}:<id>" for p in sorted(_prefixes())] + ["package.module:factory"]


def check_name(name: str) -> EnvSpec | None:
    """`spec(name)`, or a ConfigError naming what is allowed where the name is unknown."""
    found = spec(name)
    if found is None and not is_prefix_name(name):
        raise ConfigError(f"unknown env '{name}'; allowed: {', '.join(known_names())}")
    return found


def _as_spec(name: str, obj: Any, origin: str, source: str | None = None) -> EnvSpec:
    if isinstance(obj, EnvSpec):
        return EnvSpec(name, obj.factory, obj.description, dict(obj.options), dict(obj.train_defaults), obj.free_options, source)
    if callable(obj):
        doc = (inspect.getdoc(obj) or "").strip().splitlines()
        return EnvSpec(name, obj, doc[0] if doc else origin, free_options=True, source=source)
    raise ConfigError(f"env plugin '{name}' ({origin}) is a {type(obj).__name__}; expected an EnvSpec or a factory "
                      "(num_envs=, device=, seed=, **options) -> VecEnv")


def import_user_module(module: str) -> Any:
    """`module` imported, from the current directory too (a console script's path does not hold it)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0] or os.getcwd() in sys.path:
            raise
    # `phalanx` runs as a console script, whose path does not hold the current directory.
    sys.path.insert(0, os.getcwd())
    return importlib.import_module(module)


def _plugin(name: str) -> EnvSpec | None:
    module, _, attr = name.partition(":")
    if module in _prefixes() or not attr.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        return None
    try:
        mod = import_user_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            return None  # no such module: an unknown env
        raise ConfigError(f"env plugin '{name}' failed to import: {type(e).__name__}: {e}") from None
    except Exception as e:  # the user's module raised: one line, never a traceback
        raise ConfigError(f"env plugin '{name}' failed to import: {one_line(e)}") from None
    if not hasattr(mod, attr):
        raise ConfigError(f"env plugin '{name}': module '{module}' has no attribute '{attr}'")
    root = None
    if getattr(mod, "__file__", None):  # a namespace package has none
        # root/pkg/env.py for "pkg.env", root/pkg/__init__.py for "pkg": climb one level per name.
        path = Path(mod.__file__).resolve()
        root = str(path.parents[module.count(".") + (path.name == "__init__.py")])
    return _as_spec(name, getattr(mod, attr), f"{module}.{attr}", root)


def add_plugin_root(path: str) -> None:
    """Make a recorded plugin root importable (eval / resume of a run trained elsewhere)."""
    if path not in sys.path and Path(path).is_dir():
        sys.path.append(path)


def _entry_point(name: str) -> EnvSpec | None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                obj = ep.load()
            except Exception as e:
                raise ConfigError(f"env entry point '{name}' ({ep.value}) failed to load: {type(e).__name__}: {e}") from None
            return _as_spec(name, obj, ep.value)
    return None


def _coerce_option(env: str, key: str, opt: EnvOption, value: Any) -> Any:
    if opt.default is not None:
        value = coerce(value, type(opt.default), f"env option '{key}' of '{env}'")
    if opt.choices is not None and value not in opt.choices:
        raise ConfigError(
            f"env option '{key}' of '{env}' must be one of {', '.join(map(str, opt.choices))}; got {value!r}"
        )
    if (opt.min is not None and value < opt.min) or (opt.max is not None and value > opt.max):
        bounds = f"in [{opt.min}, {opt.max}]" if opt.min is not None and opt.max is not None else (
            f">= {opt.min}" if opt.min is not None else f"<= {opt.max}")
        raise ConfigError(f"env option '{key}' of '{env}' must be {bounds}; got {value!r}")
    return value


_OPTION_TYPES = {t: t for t in (bool, int, float, str)} | {t.__name__: t for t in (bool, int, float, str)}


def _factory_options(factory: Callable[..., VecEnv]) -> dict[str, inspect.Parameter]:
    """The keyword options a factory's signature takes (not num_envs, device, seed)."""
    return {k: p for k, p in inspect.signature(factory).parameters.items() if k not in ("num_envs", "device", "seed")
            and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}


def option_types(name: str) -> dict[str, type]:
    """The type each option of env `name` takes, where known: a declared option's, its default's; a plugin
    factory's, its parameter's annotation (bool, int, float or str, also as the text a postponed annotation
    is) or else its default's. Options of other types, and those of prefix names (`gym:...`), are absent."""
    s = spec(name)
    if s is None:
        return {}
    if not s.free_options:
        return {k: type(o.default) for k, o in s.options.items() if o.default is not None}
    out = {}
    for key, p in _factory_options(s.factory).items():
        if p.annotation is not inspect.Parameter.empty:
            want = _OPTION_TYPES.get(p.annotation) if isinstance(p.annotation, (type, str)) else None
        else:
            want = _OPTION_TYPES.get(type(p.default))
        if want is not None:
            out[key] = want
    return out


def resolve_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Validate and fill `options` against the env's declared options (a plugin factory's: its signature,
    typed by `option_types`)."""
    s = spec(name)
    if s is None:
        return dict(options)
    if s.free_options:
        params = inspect.signature(s.factory).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            allowed = sorted(_factory_options(s.factory))
            for key in options:
                if key not in allowed:
                    raise ConfigError(f"unknown env option '{key}' for '{name}'; allowed: {', '.join(allowed) or 'none'}")
        types = option_types(name)
        return {k: coerce(v, types[k], f"env option '{k}' of '{name}'") if k in types else v for k, v in options.items()}
    out = {}
    for key, value in options.items():
        if key not in s.options:
            allowed = ", ".join(sorted(s.options)) or "none"
            raise ConfigError(f"unknown env option '{key}' for '{name}'; allowed: {allowed}")
        out[key] = _coerce_option(name, key, s.options[key], value)
    return out


def played_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """`evaluation_options` with the training-only ones set to their defaults explicitly: a run that must train on
    the env as evaluations play it (a best response, `phalanx exploit`) keeps them off over the env's training
    defaults."""
    s = spec(name)
    off = {} if s is None else {k: o.default for k, o in s.options.items() if o.train_only}
    return {**evaluation_options(name, options), **off}


def evaluation_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A run's env options as its evaluations play them: without the env's training-only ones."""
    s = spec(name)
    if s is None or s.free_options:
        return dict(options)
    return {k: v for k, v in options.items() if not (k in s.options and s.options[k].train_only)}


def make(
    name: str,
    num_envs: int = 1,
    device: str | torch.device = "cpu",
    seed: int | None = 0,
    **options: Any,
) -> VecEnv:
    """Build a batched environment by name (see `phalanx envs` for the list)."""
    if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
        raise ConfigError(f"num_envs must be a positive integer, got {num_envs!r}")
    device = torch.device(device)
    _load(name)
    if name not in _REGISTRY and is_prefix_name(name):  # a registered `prefix:<id>` carries its own settings
        prefix, rest = name.split(":", 1)
        _load_prefix(prefix)
        return _PREFIX_FACTORIES[prefix](rest, num_envs=num_envs, device=device, seed=seed, **options)
    s = check_name(name)
    opts = resolve_options(name, options)
    try:
        env = s.factory(num_envs=num_envs, device=device, seed=seed, **opts)
    except PhalanxError:
        raise
    except Exception as e:  # a user's factory failed: one line naming it, never a traceback
        raise ConfigError(f"env '{name}': its factory raised {one_line(e)}") from None
    if not isinstance(env, VecEnv):
        raise ConfigError(f"env '{name}': its factory returned a {type(env).__name__}, not a phalanx.envs.VecEnv")
    return env
