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
    nvec: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.nvec),)

    def describe(self) -> str:
        return f"MultiDiscrete({list(self.nvec)})"


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
