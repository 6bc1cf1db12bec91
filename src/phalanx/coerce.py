"""The one conversion of user-given values (config keys, env options, command-line text) to a type.

Config keys and env options share it, so the same text means the same thing wherever it is given.
"""

from __future__ import annotations

import math
from pathlib import PurePath
from typing import Any

from phalanx.errors import ConfigError

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


def coerce(value: Any, want: type, what: str, *, parse_text: bool = True) -> Any:
    """`value` as a `want` (bool, int, float, str, list of positive ints, dict); `what` names the field
    in the one-line error, e.g. "config key 'lr'" or "env option 'max_steps' of 'cartpole'".

    `parse_text`: a string is text to read as a `want` (the command line's); without it the value is
    already typed (a file's: YAML, TOML, JSON) and must be a `want` itself, so that a quoted "8" or
    "no" in a file is refused rather than read behind the user's back. Either way an int is a float,
    a whole float an int (`1e6` steps), and a bool never a number."""
    if not parse_text and isinstance(value, str) and want is not str:
        try:
            parsed = coerce(value, want, what)
        except ConfigError:
            raise ConfigError(f"{what} must be {_wanted(want)}, got the text {value!r}") from None
        raise ConfigError(f"{what} must be {_wanted(want)}, got the text {value!r} (write {_literal(parsed, value)} without "
                          "quotes)")
    bad = ConfigError(f"{what} must be {want.__name__}, got {value!r}")
    if want is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
            return value.lower() in TRUE_WORDS
        raise bad
    if want is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        as_float = value
        if isinstance(value, str):
            text = value.replace("_", "")
            try:
                return int(text)
            except ValueError:
                pass
            try:
                as_float = float(text)  # "1e6" is a common way to write a step count
            except ValueError:
                raise bad from None
        if isinstance(as_float, float) and as_float.is_integer():
            return int(as_float)
        raise bad
    if want is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
        if not math.isfinite(out):
            raise ConfigError(f"{what} must be a finite number, got {value!r}")
        return out
    if want is str:
        if isinstance(value, (str, PurePath)):
            return str(value)
        raise bad
    if want is list:
        if isinstance(value, str):
            try:
                value = [int(v) for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
            except ValueError:
                raise bad from None
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            return list(value)
        raise ConfigError(f"{what} must be a list of positive integers, got {value!r}")
    if want is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{what} must be a mapping, got {value!r}")
    raise bad


def _wanted(want: type) -> str:
    return {bool: "bool (true or false)", list: "a list of positive integers", dict: "a mapping"}.get(want, want.__name__)


def _literal(value: Any, text: str) -> str:
    """How a file writes `value`, read from `text` (YAML, TOML and JSON alike)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return text.strip()
