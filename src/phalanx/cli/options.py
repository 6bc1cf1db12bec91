"""Command-line options the commands share: env options given as --key value, checks, durations."""

from __future__ import annotations

import argparse
from typing import Any

import torch
import yaml

from phalanx.coerce import coerce
from phalanx.envs import registry
from phalanx.errors import ConfigError, PhalanxError


def parse_env_options(extra: list[str]) -> dict[str, str]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--"):
            raise PhalanxError(f"unexpected argument '{tok}'")
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(extra):
                raise PhalanxError(f"option '--{key}' needs a value")
            value = extra[i + 1]
            i += 2
        opts[key.replace("-", "_")] = value
    return opts


def refuse_unknown_options(env_name: str, env_opts: dict[str, Any], not_what: str) -> None:
    """An option that is neither the command's own flag (`not_what`) nor one the env declares, named as the
    unknown flag it is, with both lists to choose from."""
    s = registry.check_name(env_name)
    if s is None or s.free_options:
        return
    for k in env_opts:
        if k not in s.options:
            allowed = ", ".join(sorted(s.options)) or "none"
            raise PhalanxError(f"unknown option '--{k.replace('_', '-')}' (not {not_what}; env options of '{env_name}': "
                               f"{allowed})")


def typed_env_options(env_name: str, env_opts: dict[str, str], not_what: str = "a config key") -> dict[str, Any]:
    """Env options from the command line: declared ones, and a plugin factory's that its signature types
    (`registry.option_types`), read as that type; the other keyword arguments of gym /
    pz constructors and plugin factories typed as YAML reads them (25 -> int), which the factory's
    signature (or the adapter) refuses where it does not take them."""
    s = registry.check_name(env_name)
    typed = registry.option_types(env_name)
    if s is not None and not s.free_options:
        refuse_unknown_options(env_name, env_opts, not_what)

    def read(key: str, text: str) -> Any:  # the text as the option's type, as a config file would hold it
        if key in typed:
            return coerce(text, typed[key], f"env option '{key}' of '{env_name}'")
        return text if s is not None and not s.free_options else yaml.safe_load(text)

    return {k: read(k, v) for k, v in env_opts.items()}


def duration(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def at_least_one(command: str, **counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ConfigError(f"{command} --{name.replace('_', '-')} must be >= 1, got {value}")


def apply_compute_flags(command: str, args: argparse.Namespace) -> None:
    if args.torch_threads < 0:
        raise ConfigError(f"{command} --torch-threads must be >= 0 (0: torch's default), got {args.torch_threads}")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
