"""Running statistics for observation, reward and value normalisation (device-resident)."""

from __future__ import annotations

import torch
from torch import nn


def store(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """buffer <- value in place. Through a flat view: a compiled graph (torch 2.13, every backend)
    silently drops in-place writes to a 0-d float64 tensor such as `count`, but keeps them via a view."""
    buffer.view(-1).copy_(value.reshape(-1))


class RunningMeanStd(nn.Module):
    """Parallel-update running mean/variance (Chan et al.), kept as buffers so it checkpoints."""

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4, device: torch.device | str = "cpu"):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64, device=device))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64, device=device))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64, device=device))

    @torch.no_grad()
    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold in a batch `x [..., *shape]`; `mask [...]` keeps only the selected rows."""
        x = x.reshape(-1, *self.mean.shape).to(torch.float64)
        if mask is None:
            w = torch.ones(x.shape[0], dtype=torch.float64, device=x.device)
        else:
            w = mask.reshape(-1).to(torch.float64)
        wx = w.reshape(-1, *([1] * self.mean.dim()))
        x = torch.where(wx > 0, x, torch.zeros_like(x))  # excluded rows may hold inf/NaN
        n = w.sum()
        safe_n = n.clamp_min(1.0)
        batch_mean = (x * wx).sum(0) / safe_n
        batch_var = (((x - batch_mean) ** 2) * wx).sum(0) / safe_n
        delta = batch_mean - self.mean
        tot = self.count + n
        new_mean = self.mean + delta * n / tot
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / tot
        # An all-masked batch must leave the statistics exactly as they were.
        has = n > 0
        store(self.mean, torch.where(has, new_mean, self.mean))
        store(self.var, torch.where(has, m2 / tot, self.var))
        store(self.count, torch.where(has, tot, self.count))

    def normalize(self, x: torch.Tensor, clip: float | None = None) -> torch.Tensor:
        y = (x - self.mean.to(x.dtype)) / torch.sqrt(self.var.to(x.dtype) + 1e-8)
        return y.clamp(-clip, clip) if clip is not None else y

    def denormalize(self, y: torch.Tensor) -> torch.Tensor:
        return y * torch.sqrt(self.var.to(y.dtype) + 1e-8) + self.mean.to(y.dtype)


def normalised_values(values: torch.Tensor, returns: torch.Tensor, trained: torch.Tensor,
                      value_norm: RunningMeanStd | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, returns) in the units the critic learns: as they are, or, with `value_norm`, normalised. The clip
    window is centred on what the critic output at collection: `values` in the units of the statistics it was
    denormalised with, i.e. before `value_norm` folds in the new returns (which it does here, in place)."""
    if value_norm is None:
        return values, returns
    values = value_norm.normalize(values)
    value_norm.update(returns, trained)
    return values, value_norm.normalize(returns)


def model_input(obs: torch.Tensor, obs_dims: int, image: bool, stats: RunningMeanStd | None, clip: float,
                fold: torch.Tensor | None = None) -> torch.Tensor:
    """The model's input from observations [*batch, *obs_shape] (`obs_dims` axes of them), the one preprocess of
    training and inference: uint8 pixels as they are (the CNN scales them), else float features
    [*batch, features], normalised by `stats` where given, after folding the rows `fold` [*batch] into them."""
    if image:
        return obs
    if obs_dims != 1:  # a flat space's [*batch, features] as it is: one view fewer a rollout step
        obs = obs.reshape(*obs.shape[: obs.dim() - obs_dims], -1)
    x = obs.float()
    if stats is None:
        return x
    if fold is not None:
        stats.update(x, fold)
    return stats.normalize(x, clip)


class RewardScaler(nn.Module):
    """Scales rewards by the std of the discounted return (as SB3's VecNormalize does)."""

    def __init__(self, shape: tuple[int, ...], gamma: float, device: torch.device | str = "cpu"):
        super().__init__()
        self.gamma = gamma
        self.stats = RunningMeanStd((), device=device)
        self.register_buffer("ret", torch.zeros(shape, dtype=torch.float32, device=device))

    @torch.no_grad()
    def __call__(self, reward: torch.Tensor, done: torch.Tensor, active: torch.Tensor, clip: float = 10.0) -> torch.Tensor:
        self.ret.mul_(self.gamma).add_(reward)
        self.stats.update(self.ret, active)
        scaled = reward / torch.sqrt(self.stats.var.to(reward.dtype) + 1e-8)
        self.ret.masked_fill_(done, 0.0)
        return scaled.clamp(-clip, clip)


class Normalizers(nn.Module):
    """Observation, reward and value statistics of a run: all saved with checkpoints, the observation
    statistics also used by its policy."""

    def __init__(self, obs_dim: int, num_envs: int, num_agents: int, *, norm_obs: bool, norm_reward: bool,
                 norm_value: bool, gamma: float, obs_clip: float, device: torch.device | str = "cpu"):
        super().__init__()
        self.obs = RunningMeanStd((obs_dim,), device=device) if norm_obs else None
        self.reward = RewardScaler((num_envs, num_agents), gamma, device=device) if norm_reward else None
        self.value = RunningMeanStd((), device=device) if norm_value else None
        self.obs_clip = obs_clip
