"""Small constant tensors made once per device and dtype.

Creating a tensor from Python values inside a step copies it from host memory at every call: a
wait on the host in eager mode, and an operation a CUDA graph cannot record (--cuda-graphs).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=512)
def _made(values: tuple | float, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def constant(values: tuple | float, device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.tensor(values)` on `device` (a number: a 0-d tensor), made on first use and shared after: never
    write into it."""
    if torch.compiler.is_compiling():
        # Made inside a trace, it is the trace's own (under torch.export a fake tensor): kept, the next eager call
        # got a fake tensor back (`phalanx export` of a fresh bucket_brigade run, issue 48).
        return torch.tensor(values, dtype=dtype, device=device)
    return _made(values, device, dtype)
