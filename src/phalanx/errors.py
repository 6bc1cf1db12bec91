"""Errors the command line turns into one-line messages with exit status 2."""

import errno
import re


class PhalanxError(Exception):
    """A user-facing error: bad config, unknown env, bad checkpoint. Printed as one line."""


class ConfigError(PhalanxError):
    """A config key, type or value is not allowed."""


class MissingExtraError(ConfigError):
    """What was asked for needs an optional dependency (an extra) that is not installed."""


class EnvContractError(ConfigError):
    """An environment breaks the env contract (docs/ENVIRONMENTS.md); `phalanx check-env` lists the rules."""


class CheckpointError(PhalanxError):
    """A checkpoint or run file is missing, truncated, corrupt or from another run."""


class NonFiniteLossError(PhalanxError):
    """A loss became NaN or infinite during the update."""


class NonFiniteEnvError(PhalanxError):
    """An environment returned NaN or infinite observations, states or rewards."""


class StorageError(PhalanxError):
    """A path cannot be written or read: a full disk, a read-only filesystem, a file where a directory must
    be, no permission."""


class EnvCrashError(PhalanxError):
    """An environment's own code raised during a run (its traceback is kept in the run directory)."""


class OutsidePlayerError(PhalanxError):
    """A player written outside Phalanx (`--vs module:callable`, an opponent of the league) raised, or returned what
    is no action; its own exception, where it raised, is the `__cause__` (a run keeps its traceback)."""


class Stopped(Exception):
    """A run stopped by a signal (SIGTERM from a scheduler, Ctrl-C) after its current update, with a
    checkpoint written: the message says where and how to resume; the exit status is 128 + `signum`."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` — how a foreign exception (a user's env, a plugin, a library)
    enters a one-line error."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return f"{type(e).__name__}: "
    # A first line ending in ':' only announces what follows (inductor: "An exception occurred in a
    # subprocess:" and a traceback); the cause is the last line.
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{type(e).__name__}: {lines[0]} ... {lines[-1]}"
    return f"{type(e).__name__}: {lines[0]}"


# What a user can do about the commonest storage faults, by errno name.
_STORAGE_HINTS = {"ENOSPC": "disk full", "EDQUOT": "disk quota exceeded", "EFBIG": "the file size limit"}


def storage_reason(e: BaseException) -> str:
    """Why a read or write failed, in a few words: an OSError's own text (and what it means, where the text
    alone is cryptic), or the message of a library that wraps one (safetensors: "No space left on device")."""
    if isinstance(e, OSError):
        code, text = e.errno or 0, e.strerror or str(e)
    else:  # safetensors: "Error while serializing: I/O error: No space left on device (os error 28)"
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        text = text.removeprefix("Error while serializing: ").removeprefix("I/O error: ")
        found = re.search(r"\s*\(os error (\d+)\)$", text)
        code = int(found.group(1)) if found else 0
        text = text[:found.start()] if found else text
    hint = _STORAGE_HINTS.get(errno.errorcode.get(code, ""))
    return f"{text} ({hint})" if hint and hint.lower() not in text.lower() else text
