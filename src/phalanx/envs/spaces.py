"""Per-agent observation and action spaces (the batch and agent axes are implicit).

`space.check(actions, num_envs, num_agents)` is how an env refuses bad actions: wrong dtype or shape
always (free: nothing is read), out-of-range discrete actions where reading them is free (on the CPU,
outside a compiled graph; on an accelerator it would stall the device every step, so there
`phalanx check-env` and the trainer's first step check the range instead).

A space is checked and normalised once, when built: a wrong one (a NaN bound, `n=0`, a float in `nvec`)
is an EnvContractError naming the space and what it allows, not a failure later in training.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from phalanx.consts import constant
from phalanx.draws import Source, integers, uniform
from phalanx.errors import EnvContractError


class ActionError(ValueError):
    """Actions that do not fit the action space; the message is one line."""


def _shown(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def _positive_int(value: Any) -> int | None:
    """`value` as an int where it is a positive integer (a numpy or 0-d tensor integer too; a bool is not one)."""
    if isinstance(value, bool):
        return None
    try:
        k = operator.index(value)
    except TypeError:
        return None
    return k if k > 0 else None


def _positive_ints(value: Any, space: str, field: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise EnvContractError(f"{space} {field} must be a tuple of positive ints; got {_shown(value)}")
    out = []
    for i, v in enumerate(value):
        k = _positive_int(v)
        if k is None:
            raise EnvContractError(f"{space} {field} must be a tuple of positive ints; got {_shown(v)} at index {i}")
        out.append(k)
    return tuple(out)


def _bound_values(value: Any, field: str) -> torch.Tensor:
    """A Box bound as a float64 tensor (Python floats read without rounding through float32)."""
    allowed = "a number, or numbers broadcastable to shape (a sequence, a numpy array or a tensor)"
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
    try:
        kind = torch.as_tensor(value).dtype
    except (TypeError, ValueError, RuntimeError):
        raise EnvContractError(f"Box {field} must be {allowed}; got {_shown(value)}") from None
    if kind == torch.bool or kind.is_complex:
        raise EnvContractError(f"Box {field} must be {allowed}, not {'bool' if kind == torch.bool else 'complex'}; "
                               f"got {_shown(value)}")
    values = torch.as_tensor(value, dtype=torch.float64)
    if bool(values.isnan().any()):
        raise EnvContractError(f"Box {field} must not hold NaN (-inf and +inf are allowed); got {_shown(value)}")
    return values


def _batched(actions: torch.Tensor, num_envs: int, num_agents: int, space: Space) -> torch.Tensor:
    if not isinstance(actions, torch.Tensor):
        raise ActionError(f"actions must be a torch.Tensor for {space.describe()}; got {type(actions).__name__}")
    shape = space.shape
    want = (num_envs, num_agents, *shape)
    if tuple(actions.shape) == want:
        return actions
    if num_agents == 1 and tuple(actions.shape) == (num_envs, *shape):
        return actions.unsqueeze(1)
    raise ActionError(f"actions must have shape {list(want)} for {space.describe()}; got {list(actions.shape)}")


def _value_checks_are_free(actions: torch.Tensor) -> bool:
    return actions.device.type == "cpu" and not torch.compiler.is_compiling()


def _bounds(actions: torch.Tensor) -> tuple[int, int]:
    """(min, max) of integer actions; on the CPU through the host's own values, which costs a few actions
    a fraction of two torch reductions (a gym adapter checks every step)."""
    if actions.device.type == "cpu":
        values = (actions.detach() if actions.requires_grad else actions).numpy()
        if values.size <= 64:
            flat = values.ravel().tolist()
            return min(flat), max(flat)
        return int(values.min()), int(values.max())
    return int(actions.min()), int(actions.max())


def _check_integer(actions: torch.Tensor, space: Space) -> None:
    if actions.dtype == torch.bool or actions.dtype.is_floating_point or actions.dtype.is_complex:
        raise ActionError(f"actions must have an integer dtype for {space.describe()}; got {str(actions.dtype).replace('torch.', '')}")


@dataclass(frozen=True)
class Discrete:
    """`n` actions; `slot_n` (one count per agent slot, at most `n`) where slots have fewer: slot j
    may take actions 0..slot_n[j]-1 only, and feed-forward policies mask the others out (e.g. the
    agents of a PettingZoo env whose action spaces differ)."""

    n: int
    slot_n: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = _positive_int(self.n)
        if n is None:
            raise EnvContractError(f"Discrete n must be a positive int; got {_shown(self.n)}")
        slot_n = _positive_ints(self.slot_n, "Discrete", "slot_n")
        if any(k > n for k in slot_n):
            raise EnvContractError(f"Discrete slot_n must hold counts <= n ({n}); got {list(slot_n)}")
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "slot_n", slot_n)

    @property
    def shape(self) -> tuple[int, ...]:
        """An action's shape: one integer, `()`."""
        return ()

    @staticmethod
    def per_slot(counts: tuple[int, ...]) -> Discrete:
        """The space of slots with `counts[j]` actions each: plain `Discrete(n)` where they agree."""
        if len(set(counts)) == 1:
            return Discrete(counts[0])
        return Discrete(max(counts), slot_n=tuple(counts))

    def describe(self) -> str:
        """One line for `phalanx envs` and error messages."""
        return f"Discrete({self.n}, per slot {list(self.slot_n)})" if self.slot_n else f"Discrete({self.n})"

    def valid_actions(self) -> torch.Tensor | None:
        """[A, n] bool: which actions each slot may take (None: every slot all n)."""
        if not self.slot_n:
            return None
        return torch.arange(self.n) < torch.tensor(self.slot_n).unsqueeze(1)

    @property
    def mask_width(self) -> int:
        """The last axis of an action mask (`StepRecord.action_mask` [N, A, mask_width])."""
        return self.n

    def allows_nothing(self, mask: torch.Tensor) -> torch.Tensor:
        """[..., A] bool: where `mask` [..., A, n] leaves a slot no action it has."""
        valid = self.valid_actions()
        return ~(mask if valid is None else mask & valid.to(mask.device)).any(-1)

    def sample(self, num_envs: int, num_agents: int, generator: Source, device: torch.device | str,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Uniformly random valid actions [N, A]; with `mask` [N, A, n], uniform over the actions it allows."""
        if mask is not None:
            valid = self.valid_actions()
            legal = mask if valid is None else mask & valid.to(mask.device)
            return _uniform_legal(legal, generator, device)
        if not self.slot_n:
            return integers(generator, 0, self.n, (num_envs, num_agents), device)
        limits = constant(tuple(self.slot_n), device, torch.long)
        return (uniform(generator, (num_envs, num_agents), device) * limits).long().clamp_max(limits - 1)

    def check(self, actions: torch.Tensor, num_envs: int, num_agents: int, values: bool | None = None) -> torch.Tensor:
        """-> actions [N, A]; ActionError for a float dtype, a wrong shape or (where `values`, by default
        where reading is free) a value outside [0, n)."""
        actions = _batched(actions, num_envs, num_agents, self)
        _check_integer(actions, self)
        if (_value_checks_are_free(actions) if values is None else values) and actions.numel():
            lo, hi = _bounds(actions)
            if lo < 0 or hi >= self.n:
                raise ActionError(f"actions must lie in [0, {self.n}) for {self.describe()}; got {lo if lo < 0 else hi}")
            if self.slot_n:
                over = actions >= torch.tensor(self.slot_n, device=actions.device)
                if bool(over.any()):
                    j = int(over.any(0).nonzero()[0])
                    raise ActionError(f"actions[:, {j}] must lie in [0, {self.slot_n[j]}) for {self.describe()}; got {int(actions[:, j].max())}")
        return actions


@dataclass(frozen=True)
class MultiDiscrete:
    """Several categorical sub-actions. `gates` declares sub-actions the env ignores unless another
    one takes a value: (head, on_head, value) means head `head` matters only where
    action[on_head] == value (e.g. a target that only counts when working). Policies leave gated-off
    sub-actions out of log-probabilities and entropy, so they carry no gradient noise."""

    nvec: tuple[int, ...]
    gates: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        nvec = _positive_ints(self.nvec, "MultiDiscrete", "nvec")
        if not nvec:
            raise EnvContractError("MultiDiscrete nvec must be a non-empty tuple of positive ints; got an empty one")
        if isinstance(self.gates, (str, bytes)) or not hasattr(self.gates, "__iter__"):
            raise EnvContractError(f"MultiDiscrete gates must be a tuple of (head, on_head, value); got {_shown(self.gates)}")
        object.__setattr__(self, "nvec", nvec)
        object.__setattr__(self, "gates", tuple(self._gate(g) for g in self.gates))

    def _gate(self, gate: Any) -> tuple[int, int, int]:
        form = "a gate must be (head, on_head, value), three ints"
        if isinstance(gate, (str, bytes)) or not hasattr(gate, "__len__") or len(gate) != 3:
            raise EnvContractError(f"MultiDiscrete {form}; got {_shown(gate)}")
        try:
            head, on_head, value = (operator.index(x) for x in gate)
        except TypeError:
            raise EnvContractError(f"MultiDiscrete {form}; got {_shown(gate)}") from None
        heads = len(self.nvec)
        for name, h in (("head", head), ("on_head", on_head)):
            if not 0 <= h < heads:
                raise EnvContractError(f"MultiDiscrete gate {_shown(gate)}: {name} {h} must lie in [0, {heads})")
        if head == on_head:
            raise EnvContractError(f"MultiDiscrete gate {_shown(gate)}: a head cannot be gated on itself")
        if not 0 <= value < self.nvec[on_head]:
            raise EnvContractError(f"MultiDiscrete gate {_shown(gate)}: value {value} must lie in [0, {self.nvec[on_head]}) "
                                   f"(the values of head {on_head})")
        return head, on_head, value

    @property
    def shape(self) -> tuple[int, ...]:
        """An action's shape: one integer per head, `(len(nvec),)`."""
        return (len(self.nvec),)

    def describe(self) -> str:
        """One line for `phalanx envs` and error messages."""
        gated = "".join(f", head {h} only when head {j} == {v}" for h, j, v in self.gates)
        return f"MultiDiscrete({list(self.nvec)}{gated})"

    @property
    def mask_width(self) -> int:
        """The last axis of an action mask: each head's values in turn (`StepRecord.action_mask` [N, A, sum(nvec)])."""
        return sum(self.nvec)

    def allows_nothing(self, mask: torch.Tensor) -> torch.Tensor:
        """[..., A] bool: where `mask` [..., A, sum(nvec)] leaves some head of a slot no value."""
        return torch.stack([~part.any(-1) for part in mask.split(self.nvec, -1)], -1).any(-1)

    def sample(self, num_envs: int, num_agents: int, generator: Source, device: torch.device | str,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Uniformly random actions [N, A, k]; with `mask` [N, A, sum(nvec)], each head uniform over the values
        it allows."""
        if mask is not None:
            return _uniform_legal(mask, generator, device, self.nvec)
        nvec = constant(tuple(self.nvec), device, torch.long)
        u = uniform(generator, (num_envs, num_agents, len(self.nvec)), device)
        return (u * nvec).long().clamp_max(nvec - 1)

    def check(self, actions: torch.Tensor, num_envs: int, num_agents: int, values: bool | None = None) -> torch.Tensor:
        """-> actions [N, A, k]; as `Discrete.check`, per sub-action."""
        actions = _batched(actions, num_envs, num_agents, self)
        _check_integer(actions, self)
        if (_value_checks_are_free(actions) if values is None else values) and actions.numel():
            nvec = torch.tensor(self.nvec, device=actions.device)
            bad = (actions < 0) | (actions >= nvec)
            if bool(bad.any()):
                head = int(bad.reshape(-1, len(self.nvec)).any(0).nonzero()[0])
                got = int(actions.reshape(-1, len(self.nvec))[:, head][bad.reshape(-1, len(self.nvec))[:, head]][0])
                raise ActionError(f"actions[..., {head}] must lie in [0, {self.nvec[head]}) for {self.describe()}; got {got}")
        return actions


def _uniform_legal(legal: torch.Tensor, generator: Source, device: torch.device | str,
                   heads: tuple[int, ...] = ()) -> torch.Tensor:
    """Uniform draws among the True entries of `legal` [N, A, width] (per head of `heads`, where given): the
    largest of one uniform per entry, the forbidden ones out of the race. A row that allows nothing gets 0."""
    legal = legal.to(device)
    u = uniform(generator, tuple(legal.shape), device)
    race = torch.where(legal, u, -1.0)
    if not heads:
        return race.argmax(-1)
    return torch.stack([part.argmax(-1) for part in race.split(heads, -1)], -1)


def _torch_dtype(dtype: Any) -> torch.dtype:
    """A gymnasium-style dtype (np.float32, np.uint8, "float32") as the torch dtype a batched env holds."""
    try:
        kind = np.dtype(dtype)
        return torch.from_numpy(np.zeros(0, dtype=kind)).dtype
    except (TypeError, ValueError):
        raise EnvContractError(f"Box dtype must be a torch or numpy dtype (torch.float32, or torch.uint8 for pixels); "
                               f"got {_shown(dtype)}") from None


@dataclass(frozen=True)
class Box:
    """Bounds `low` and `high` as gymnasium takes them: numbers, sequences, numpy arrays or tensors
    broadcastable to `shape` (without a shape, the bounds' own: two numbers make shape (1,)); held as
    one float per element, flattened in row-major order. -inf and +inf are allowed, NaN is not."""

    low: tuple[float, ...]
    high: tuple[float, ...]
    shape: tuple[int, ...] = None  # type: ignore[assignment]  # None: the bounds' own shape
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        low, high = _bound_values(self.low, "low"), _bound_values(self.high, "high")
        if self.shape is None:
            shape = tuple(torch.broadcast_shapes(low.shape, high.shape)) or (1,)
        elif isinstance(self.shape, (str, bytes)) or not hasattr(self.shape, "__iter__"):
            raise EnvContractError(f"Box shape must be a tuple of positive ints; got {_shown(self.shape)}")
        else:
            shape = _positive_ints(self.shape, "Box", "shape")
        if not isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", _torch_dtype(self.dtype))
        flat = {}
        for field, values in (("low", low), ("high", high)):
            try:
                flat[field] = values.broadcast_to(shape).reshape(-1)
            except RuntimeError:
                raise EnvContractError(f"Box {field} of shape {list(values.shape)} does not broadcast to shape {list(shape)}"
                                       " (give a number, or one value per element)") from None
        low, high = flat["low"], flat["high"]
        for field, values, wrong in (("low", low, math.inf), ("high", high, -math.inf)):
            if bool((values == wrong).any()):
                raise EnvContractError(f"Box {field} must not be {wrong:+} (a side without a bound is low=-inf or high=+inf); "
                                       f"got {_shown(getattr(self, field))}")
        upside_down = (low > high).nonzero()
        if len(upside_down):
            i = int(upside_down[0])
            raise EnvContractError(f"Box low must be <= high everywhere; got low {low[i].item():g} > high {high[i].item():g} "
                                   f"at index {i} of the flattened shape {list(shape)}")
        object.__setattr__(self, "low", tuple(low.tolist()))
        object.__setattr__(self, "high", tuple(high.tolist()))
        object.__setattr__(self, "shape", shape)

    @staticmethod
    def uniform(low: float, high: float, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Box:
        """A box of `shape` with the same bounds on every side."""
        return Box(low, high, shape, dtype)

    def low_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The lower bounds as a tensor of `shape` on `device`."""
        return constant(tuple(self.low), device).reshape(self.shape)

    def high_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The upper bounds as a tensor of `shape` on `device`."""
        return constant(tuple(self.high), device).reshape(self.shape)

    def sample(self, num_envs: int, num_agents: int, generator: Source, device: torch.device | str) -> torch.Tensor:
        """Uniformly random actions [N, A, *shape] (an unbounded side is drawn within [-1, 1])."""
        low, high = self.low_tensor(device), self.high_tensor(device)
        lo = torch.where(torch.isfinite(low), low, torch.full_like(low, -1.0))
        hi = torch.where(torch.isfinite(high), high, torch.full_like(high, 1.0))
        return lo + (hi - lo) * uniform(generator, (num_envs, num_agents, *self.shape), device)

    def check(self, actions: torch.Tensor, num_envs: int, num_agents: int, values: bool | None = None) -> torch.Tensor:
        """-> actions [N, A, *shape]; ActionError for a non-float dtype or a wrong shape (the env clips or
        rejects values outside [low, high] as its dynamics say)."""
        actions = _batched(actions, num_envs, num_agents, self)
        if not actions.dtype.is_floating_point:
            raise ActionError(f"actions must have a floating dtype for {self.describe()}; got {str(actions.dtype).replace('torch.', '')}")
        return actions

    def describe(self) -> str:
        """One line for `phalanx envs` and error messages."""
        lo, hi = min(self.low), max(self.high)
        return f"Box(shape={list(self.shape)}, low={lo:g}, high={hi:g}, dtype={str(self.dtype).replace('torch.', '')})"


Space = Discrete | MultiDiscrete | Box
