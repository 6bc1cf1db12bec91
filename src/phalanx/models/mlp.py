"""MLP actor-critic for discrete, multi-discrete and continuous actions."""

from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.envs.spaces import Box, Discrete, MultiDiscrete, Space
from phalanx.models import distributions as D


class _SigmoidTanh(torch.autograd.Function):
    """tanh as 2*sigmoid(2x) - 1: on many CPUs torch.tanh is ~5x slower than sigmoid, and tanh
    dominated the rollout (abs. difference from torch.tanh < 2e-7)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x * 2).mul_(2).sub_(1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)


class FastTanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SigmoidTanh.apply(x) if x.device.type == "cpu" else torch.tanh(x)


ACTIVATIONS = {"tanh": FastTanh, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}


def layer_init(layer: nn.Linear, gain: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, bias)
    return layer


def mlp(in_dim: int, hidden: tuple[int, ...], out_dim: int, activation: str, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = in_dim
    for h in hidden:
        layers += [layer_init(nn.Linear(d, h)), ACTIVATIONS[activation]()]
        d = h
    layers.append(layer_init(nn.Linear(d, out_dim), gain=out_gain))
    return nn.Sequential(*layers)


class ActionHead(nn.Module):
    """Turns actor features into a distribution over the action space."""

    def __init__(self, space: Space, init_log_std: float = 0.0):
        super().__init__()
        self.space = space
        if isinstance(space, Discrete):
            self.kind, self.out_dim = "discrete", space.n
        elif isinstance(space, MultiDiscrete):
            self.kind, self.out_dim = "multi", int(sum(space.nvec))
        elif isinstance(space, Box):
            self.kind = "gaussian"
            self.out_dim = int(math.prod(space.shape))
            self.log_std = nn.Parameter(torch.full((self.out_dim,), float(init_log_std)))
            self.register_buffer("low", torch.tensor(space.low, dtype=torch.float32))
            self.register_buffer("high", torch.tensor(space.high, dtype=torch.float32))
        else:
            raise TypeError(f"unsupported action space {space!r}")

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.kind == "multi":
            return D.pad_multi_logits(out, tuple(self.space.nvec))
        return out

    def sample(self, out: torch.Tensor, generator: torch.Generator | None, greedy: bool) -> torch.Tensor:
        if self.kind == "gaussian":
            return out if greedy else D.gaussian_sample(out, self.log_std, generator)
        logits = self._logits(out)
        return logits.argmax(-1) if greedy else D.categorical_sample(logits, generator)

    def log_prob(self, out: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        if self.kind == "gaussian":
            return D.gaussian_log_prob(out, self.log_std, actions)
        lp = D.categorical_log_prob(self._logits(out), actions)
        return lp.sum(-1) if self.kind == "multi" else lp

    def entropy(self, out: torch.Tensor) -> torch.Tensor:
        if self.kind == "gaussian":
            return D.gaussian_entropy(out, self.log_std)
        ent = D.categorical_entropy(self._logits(out))
        return ent.sum(-1) if self.kind == "multi" else ent

    def to_env(self, actions: torch.Tensor) -> torch.Tensor:
        """The action the env receives: Gaussian samples are clipped to the bounds."""
        if self.kind == "gaussian":
            return torch.maximum(torch.minimum(actions, self.high), self.low)
        return actions


class MLPActorCritic(nn.Module):
    """Separate actor and critic MLPs (as CleanRL), orthogonally initialised.

    Inputs carry any leading batch axes, e.g. [N, A, obs_dim]. The critic reads `critic_dim`
    features (the observation for IPPO, a global state for MAPPO).
    """

    def __init__(
        self,
        obs_dim: int,
        action_space: Space,
        hidden: tuple[int, ...] = (64, 64),
        activation: str = "tanh",
        critic_dim: int | None = None,
        init_log_std: float = 0.0,
    ):
        super().__init__()
        self.head = ActionHead(action_space, init_log_std)
        self.actor = mlp(obs_dim, hidden, self.head.out_dim, activation, out_gain=0.01)
        self.critic = mlp(critic_dim or obs_dim, hidden, 1, activation, out_gain=1.0)

    def value(self, critic_in: torch.Tensor) -> torch.Tensor:
        return self.critic(critic_in).squeeze(-1)

    def act(
        self, obs: torch.Tensor, generator: torch.Generator | None = None, greedy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.actor(obs)
        action = self.head.sample(out, generator, greedy)
        return action, self.head.log_prob(out, action)

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.actor(obs)
        return self.head.log_prob(out, actions), self.head.entropy(out)
