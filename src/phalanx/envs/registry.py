"""Name -> environment factory, with declared options and per-env training defaults."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.coerce import coerce
from phalanx.envs.base import VecEnv
from phalanx.errors import ConfigError


@dataclass(frozen=True)
class EnvOption:
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class EnvSpec:
    name: str
    factory: Callable[..., VecEnv]
    description: str
    options: dict[str, EnvOption] = field(default_factory=dict)
    # Training defaults that suit this env (merged over the schema defaults, under user config).
    train_defaults: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, EnvSpec] = {}
_PREFIX_FACTORIES: dict[str, Callable[..., VecEnv]] = {}


def register(spec: EnvSpec) -> None:
    _REGISTRY[spec.name] = spec


def register_prefix(prefix: str, factory: Callable[..., VecEnv]) -> None:
    """`prefix:<rest>` names are built by `factory(rest, num_envs=, device=, seed=, **options)`."""
    _PREFIX_FACTORIES[prefix] = factory


def registered() -> dict[str, EnvSpec]:
    return dict(_REGISTRY)


def spec(name: str) -> EnvSpec | None:
    return _REGISTRY.get(name)


def _coerce_option(env: str, key: str, opt: EnvOption, value: Any) -> Any:
    if opt.default is not None:
        value = coerce(value, type(opt.default), f"env option '{key}' of '{env}'")
    if opt.choices is not None and value not in opt.choices:
        raise ConfigError(
            f"env option '{key}' of '{env}' must be one of {', '.join(map(str, opt.choices))}; got {value!r}"
        )
    return value


def resolve_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Validate and fill `options` against the env's declared options."""
    s = _REGISTRY.get(name)
    if s is None:
        return dict(options)
    out = {}
    for key, value in options.items():
        if key not in s.options:
            allowed = ", ".join(sorted(s.options)) or "none"
            raise ConfigError(f"unknown env option '{key}' for '{name}'; allowed: {allowed}")
        out[key] = _coerce_option(name, key, s.options[key], value)
    return out


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
    if ":" in name:
        prefix, rest = name.split(":", 1)
        if prefix in _PREFIX_FACTORIES:
            return _PREFIX_FACTORIES[prefix](rest, num_envs=num_envs, device=device, seed=seed, **options)
    s = _REGISTRY.get(name)
    if s is None:
        known = sorted(_REGISTRY) + [f"{p}:<id>" for p in sorted(_PREFIX_FACTORIES)]
        raise ConfigError(f"unknown env '{name}'; allowed: {', '.join(known)}")
    opts = resolve_options(name, options)
    return s.factory(num_envs=num_envs, device=device, seed=seed, **opts)
