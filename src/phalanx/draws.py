"""Random draws that a captured graph can replay: torch.compile cannot take a `torch.Generator`.

`Draws` wraps one generator. Eager, each call draws from it directly. Inside `recording()` the calls
also note what they drew (kind, shape, dtype, bounds): the plan of one step. Before a captured
step, `ahead()` draws that plan eagerly, in order, from the same generator, and inside the graph the
calls hand those tensors out in turn. One generator drawn in one order gives the same numbers either
way, so a compiled rollout draws exactly what the eager one draws, and a resumed run continues the
stream bit-identically (the generator's state is the whole state).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import NamedTuple

import torch


class Draw(NamedTuple):
    kind: str  # "rand", "randn" or "randint"
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    low: int = 0
    high: int = 0


def draw_from(generator: torch.Generator | None, d: Draw) -> torch.Tensor:
    if d.kind == "randint":
        return torch.randint(d.low, d.high, d.shape, generator=generator, dtype=d.dtype, device=d.device)
    fn = torch.rand if d.kind == "rand" else torch.randn
    return fn(d.shape, generator=generator, dtype=d.dtype, device=d.device)


class Draws:
    """A generator's draws, replayable inside a captured graph (see the module docstring)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.plan: list[Draw] = []
        self._recording = False
        self._queue: list[torch.Tensor] | None = None
        self._next = 0

    def rand(self, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Uniform on [0, 1)."""
        if self._queue is not None:
            return self._take()
        return self._draw(Draw("rand", tuple(shape), dtype, torch.device(device)))

    def randn(self, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal."""
        if self._queue is not None:
            return self._take()
        return self._draw(Draw("randn", tuple(shape), dtype, torch.device(device)))

    def randint(self, low: int, high: int, shape: tuple[int, ...], device: torch.device | str,
                dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Integers uniform on [low, high)."""
        if self._queue is not None:
            return self._take()
        return self._draw(Draw("randint", tuple(shape), dtype, torch.device(device), int(low), int(high)))

    def _take(self) -> torch.Tensor:
        x = self._queue[self._next]
        self._next += 1
        return x

    def _draw(self, d: Draw) -> torch.Tensor:
        if self._recording:
            self.plan.append(d)
        return draw_from(self.generator, d)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Note the draws made inside as the plan that `ahead` replays (an eager step)."""
        self.plan, self._recording = [], True
        try:
            yield
        finally:
            self._recording = False

    def ahead(self) -> AbstractContextManager[None]:
        """Draw the plan now; inside, the calls hand it out in order (a captured step). A step that
        draws other than its plan is an error, never a silent change of the random stream."""
        return self.replaying([draw_from(self.generator, d) for d in self.plan])

    def buffers(self) -> list[torch.Tensor]:
        """Empty tensors shaped as the plan's draws: the static inputs of a CUDA graph (see `refill`)."""
        return [torch.empty(d.shape, dtype=d.dtype, device=d.device) for d in self.plan]

    def refill(self, queue: list[torch.Tensor]) -> None:
        """Draw the plan into `queue` (from `buffers`) in place: what `ahead` would draw, at fixed addresses."""
        for q, d in zip(queue, self.plan):
            q.copy_(draw_from(self.generator, d))

    @contextmanager
    def replaying(self, queue: list[torch.Tensor]) -> Iterator[None]:
        """Inside, the calls hand out `queue` in order (the plan's draws, made beforehand)."""
        self._queue, self._next = queue, 0
        try:
            yield
            if self._next != len(self.plan):
                raise RuntimeError(f"a captured step drew {self._next} times but its recorded plan has {len(self.plan)} draws")
        finally:
            self._queue, self._next = None, 0


Source = torch.Generator | Draws | None


def uniform(source: Source, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform [0, 1) draws from a generator (None: the global one) or from `Draws`."""
    if isinstance(source, Draws):
        return source.rand(shape, device, dtype)
    return torch.rand(shape, generator=source, device=device, dtype=dtype)


def integers(source: Source, low: int, high: int, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Integers uniform on [low, high) from a generator (None: the global one) or from `Draws`."""
    if isinstance(source, Draws):
        return source.randint(low, high, shape, device)
    return torch.randint(low, high, shape, generator=source, device=device)


def normal(source: Source, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal draws from a generator (None: the global one) or from `Draws`."""
    if isinstance(source, Draws):
        return source.randn(shape, device, dtype)
    return torch.randn(shape, generator=source, device=device, dtype=dtype)
