"""The layers the models are built of: the activations (FastTanh, the CPU speed form of tanh), Linear (a
narrow-layer fast path), layer_init, RoleLinear (per-role weights) and the MLP."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

# Below this many elements torch.tanh itself is the faster form, forward and backward (a 64-wide layer
# of up to 256 rows on a 2-core CPU: the custom function's dispatch cost more than tanh's arithmetic).
PLAIN_TANH_MAX_ELEMENTS = 16384


class _FastTanhFunction(torch.autograd.Function):
    """tanh as 2 sigmoid(2x) - 1 (`_sigmoid_tanh`), its gradient from the output as torch.tanh's (1 - y^2)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # ctx in forward, not a separate setup_context: with one, every apply binds its arguments
        # through inspect.signature.
        y = _sigmoid_tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)


class FastTanh(nn.Module):
    """tanh, in the fastest form on the device. On a CPU torch.tanh is several times slower than sigmoid on
    large tensors and dominated the rollout: from `PLAIN_TANH_MAX_ELEMENTS` on, 2 sigmoid(2x) - 1 (one kernel;
    abs. difference from torch.tanh < 2e-7), and in a compiled rollout a rational function (inductor fuses
    its multiply-adds into one loop, faster than its exp; eager, each of its ops would be a pass over
    memory). Training keeps the sigmoid form, compiled too: there inductor recomputed the rational chain in
    the backward instead of saving its output, a slower update. The timings: docs/BENCHMARKS.md."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu or x.numel() <= PLAIN_TANH_MAX_ELEMENTS:
            return torch.tanh(x)
        if x.requires_grad:
            return _FastTanhFunction.apply(x)
        if torch.compiler.is_compiling():
            return _rational_tanh(x)
        # Inference (the rollout, evaluation): the same arithmetic without autograd.Function's dispatch,
        # which cost a small-batch rollout more than the forward itself.
        return _sigmoid_tanh(x)


def _sigmoid_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * 2).mul_(2).sub_(1)


# tanh(x) ~ x P(x^2) / Q(x^2) on [-8, 8] (tanh(8) is 1 to float32's precision beyond it): a weighted
# least-squares fit of ours, reweighted towards the smallest largest error; in float32 within 3.5e-7 of
# tanh everywhere and never above 1 in magnitude.
RATIONAL_TANH_BOUND = 8.0
RATIONAL_TANH_P = (9.9999999118e-01, 1.3121025457e-01, 3.1456719987e-03, 1.1604223457e-05, -2.2160715563e-08,
                   6.2910764132e-11, -1.1369417902e-13)
RATIONAL_TANH_Q = (1.0, 4.6454354791e-01, 2.4660241059e-02, 2.6076239147e-04)


def _rational_tanh(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp(-RATIONAL_TANH_BOUND, RATIONAL_TANH_BOUND)
    s = x * x
    return x * _polynomial(s, RATIONAL_TANH_P) / _polynomial(s, RATIONAL_TANH_Q)


def _polynomial(s: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    out = s * coefficients[-1] + coefficients[-2]
    for c in reversed(coefficients[:-2]):
        out = out * s + c
    return out


ACTIVATIONS = {"tanh": FastTanh, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}

# A layer with at most this many input features (and at least `NARROW_WEIGHT_GRAD_MIN_ROWS` rows) computes
# its weight gradient as x^T @ grad: torch computes grad^T @ x, a product whose result is `in_features`
# wide, which MKL runs several times slower below 16 columns (docs/BENCHMARKS.md).
NARROW_INPUT_MAX_FEATURES = 15
# Below this many rows the custom function's dispatch costs more than the product saves.
NARROW_WEIGHT_GRAD_MIN_ROWS = 512


class _LinearFunction(torch.autograd.Function):
    """F.linear (the same forward, so the same numbers as inference) whose backward products suit the
    layer's shape: with `broadcast`, both gradients as broadcast products and sums (a compiled narrow
    output, see NARROW_OUTPUT_MAX_FEATURES), else the weight gradient as (x^T @ grad)^T (a narrow input)
    and the input's as torch computes it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, broadcast: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.broadcast = bias is not None, broadcast
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        # Under autocast the forward ran in `grad`'s dtype (bfloat16): so do the products, as autograd's
        # would through autocast's casts; the engine casts each gradient back to its input's dtype.
        dtype = grad.dtype
        grad_rows, x_rows, weight = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(dtype), weight.to(dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.unsqueeze(-1) * weight).sum(-2) if ctx.broadcast else grad.matmul(weight)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_rows.unsqueeze(-1) * x_rows.unsqueeze(-2)).sum(0) if ctx.broadcast else x_rows.t().mm(grad_rows).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b, None


# Compiled, a layer with at most this many outputs (a value or a two-action head) has both gradients
# computed as broadcast products and sums, which inductor fuses into the kernels around them; as
# products with an inner dimension of 1 or 2 they were separate matrix calls, twice as slow in a value
# head's backward (docs/BENCHMARKS.md). Eager, every op would be a pass.
NARROW_OUTPUT_MAX_FEATURES = 2


class Linear(nn.Linear):
    """nn.Linear whose training backward suits its shape (`_LinearFunction`, from
    NARROW_WEIGHT_GRAD_MIN_ROWS rows): the same parameters, state dict and forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad and x.numel() >= NARROW_WEIGHT_GRAD_MIN_ROWS * self.in_features:
            if self.out_features <= NARROW_OUTPUT_MAX_FEATURES and torch.compiler.is_compiling():
                return _LinearFunction.apply(x, self.weight, self.bias, True)
            if self.in_features <= NARROW_INPUT_MAX_FEATURES:
                return _LinearFunction.apply(x, self.weight, self.bias, False)
        return F.linear(x, self.weight, self.bias)


def layer_init(layer: nn.Linear, gain: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, bias)
    return layer


class RoleLinear(nn.Module):
    """One linear layer per role, applied to the agent axis: x [..., A, in] -> [..., A, out].

    `roles [A]` maps each agent slot to its parameter set, so the agent axis is one batched
    matmul, never a Python loop over agents.
    """

    def __init__(self, in_dim: int, out_dim: int, roles: torch.Tensor, gain: float):
        super().__init__()
        groups = int(roles.max()) + 1
        self.register_buffer("roles", roles.clone().long())
        self.weight = nn.Parameter(torch.empty(groups, in_dim, out_dim))
        self.bias = nn.Parameter(torch.zeros(groups, out_dim))
        for g in range(groups):
            w = torch.empty(out_dim, in_dim)
            nn.init.orthogonal_(w, gain)
            self.weight.data[g] = w.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...ai,aio->...ao", x, self.weight[self.roles]) + self.bias[self.roles]


class MLP(nn.Sequential):
    """Layers in sequence, each called through its `forward`: nn.Module.__call__'s hook handling cost more
    than a small batch's matmul (a 4-env rollout made 69k module calls for 23k layer forwards), and these
    layers take no hooks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer.forward(x)
        return x


def mlp(
    in_dim: int, hidden: tuple[int, ...], out_dim: int, activation: str, out_gain: float, roles: torch.Tensor | None = None
) -> MLP:
    """An MLP; with `roles`, every layer has one parameter set per role (see RoleLinear)."""

    def linear(i: int, o: int, gain: float) -> nn.Module:
        return layer_init(Linear(i, o), gain) if roles is None else RoleLinear(i, o, roles, gain)

    layers: list[nn.Module] = []
    d = in_dim
    for h in hidden:
        layers += [linear(d, h, math.sqrt(2)), ACTIVATIONS[activation]()]
        d = h
    layers.append(linear(d, out_dim, out_gain))
    return MLP(*layers)
