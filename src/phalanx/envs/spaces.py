"""Per-agent observation and action spaces (the batch and agent axes are implicit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Discrete:
    n: int

    @property
    def shape(self) -> tuple[int, ...]:
        return ()

    def describe(self) -> str:
        return f"Discrete({self.n})"


@dataclass(frozen=True)
class MultiDiscrete:
    """Several categorical sub-actions. `gates` declares sub-actions the env ignores unless another
    one takes a value: (head, on_head, value) means head `head` matters only where
    action[on_head] == value (e.g. a target that only counts when working). Policies leave gated-off
    sub-actions out of log-probabilities and entropy, so they carry no gradient noise."""

    nvec: tuple[int, ...]
    gates: tuple[tuple[int, int, int], ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.nvec),)

    def describe(self) -> str:
        gated = "".join(f", head {h} only when head {j} == {v}" for h, j, v in self.gates)
        return f"MultiDiscrete({list(self.nvec)}{gated})"


@dataclass(frozen=True)
class Box:
    low: tuple[float, ...]
    high: tuple[float, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @staticmethod
    def uniform(low: float, high: float, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Box:
        n = 1
        for s in shape:
            n *= s
        return Box((float(low),) * n, (float(high),) * n, tuple(shape), dtype)

    def low_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.low, dtype=torch.float32, device=device).reshape(self.shape)

    def high_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.high, dtype=torch.float32, device=device).reshape(self.shape)

    def describe(self) -> str:
        lo, hi = min(self.low), max(self.high)
        return f"Box(shape={list(self.shape)}, low={lo:g}, high={hi:g}, dtype={str(self.dtype).replace('torch.', '')})"


Space = Discrete | MultiDiscrete | Box
