"""Linear recurrences solved with a parallel (Hillis-Steele) scan: log2(T) batched tensor ops
instead of a Python loop of T small ones."""

from __future__ import annotations

import torch


def linear_scan(a: torch.Tensor, b: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """For x_t = a_t * x_{t-1} + b_t along `dim`, return (prod_{s<=t} a_s, x_t from x_{-1} = 0).

    The state before the sequence enters as `x_t = p_t * x0 + c_t` with (p, c) the returned pair.
    Only products and sums, so values equal the sequential loop up to float rounding.
    """
    dim = dim % a.dim()
    length, shift = a.shape[dim], 1
    while shift < length:
        keep, new = a.narrow(dim, 0, shift), a.narrow(dim, shift, length - shift)
        b = torch.cat([b.narrow(dim, 0, shift), new * b.narrow(dim, 0, length - shift) + b.narrow(dim, shift, length - shift)], dim)
        a = torch.cat([keep, new * a.narrow(dim, 0, length - shift)], dim)
        shift *= 2
    return a, b
