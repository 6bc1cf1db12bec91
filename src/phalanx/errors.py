"""Errors the command line turns into one-line messages with exit status 2."""


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
