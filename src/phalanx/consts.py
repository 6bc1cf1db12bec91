"""Small constant tensors made once per device and dtype.

Creating a tensor from Python values inside a step copies it from host memory at every call: a
wait on the host in eager mode, and an operation a CUDA graph cannot record (--cuda-graphs).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=512)
def constant(values: tuple | float, device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.tensor(values)` on `device` (a number: a 0-d tensor), made on first use and shared after: never
    write into it."""
    return torch.tensor(values, dtype=dtype, device=device)
