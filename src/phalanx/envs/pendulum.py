"""Pendulum-v1 as a batched torch environment, matching gymnasium's dynamics step for step."""

from __future__ import annotations

import math

import torch

from phalanx.envs.cartpole import ClassicEnv
from phalanx.envs.registry import EnvOption, EnvSpec, register
from phalanx.envs.spaces import Box

MAX_SPEED = 8.0
MAX_TORQUE = 2.0
DT = 0.05
G = 10.0
M = 1.0
L = 1.0


def angle_normalize(x: torch.Tensor) -> torch.Tensor:
    """Wrap angles to [-pi, pi) (torch's % is a floored modulo, like numpy's)."""
    return ((x + math.pi) % (2 * math.pi)) - math.pi


def pendulum_dynamics(state: torch.Tensor, torque: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of gymnasium's Pendulum. state [N, 2] (theta, theta_dot), torque [N] (unclipped).

    Returns (next_state [N, 2], reward [N] in the state's dtype).
    """
    th, thdot = state.unbind(-1)
    # The torque keeps its own dtype (float32 actions), as numpy does in gymnasium's step.
    u = torque.clamp(-MAX_TORQUE, MAX_TORQUE)
    costs = angle_normalize(th) ** 2 + 0.1 * thdot**2 + 0.001 * (u**2)
    newthdot = thdot + (3 * G / (2 * L) * torch.sin(th) + 3.0 / (M * L**2) * u) * DT
    newthdot = newthdot.clamp(-MAX_SPEED, MAX_SPEED)
    newth = th + newthdot * DT
    return torch.stack((newth, newthdot), -1), -costs


class PendulumEnv(ClassicEnv):
    """gymnasium Pendulum-v1: torque in [-2, 2] swings the pole up; 200-step limit, never terminates."""

    name = "pendulum"
    state_dim = 2
    observation_space = Box(low=(-1.0, -1.0, -MAX_SPEED), high=(1.0, 1.0, MAX_SPEED), shape=(3,))
    action_space = Box.uniform(-MAX_TORQUE, MAX_TORQUE, (1,))

    def __init__(self, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0, max_steps: int = 200) -> None:
        super().__init__(num_envs, device, seed, max_steps)

    def _sample_start(self) -> torch.Tensor:
        u = torch.rand(self.num_envs, 2, generator=self.gen, dtype=torch.float64, device=self.device) * 2 - 1
        return torch.stack((u[:, 0] * math.pi, u[:, 1]), -1)

    def _transition(self, state, actions):
        nxt, reward = pendulum_dynamics(state, actions.reshape(self.num_envs))
        terminated = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return nxt, reward.float(), terminated

    def _observe(self, state: torch.Tensor) -> torch.Tensor:
        th, thdot = state.unbind(-1)
        return torch.stack((torch.cos(th), torch.sin(th), thdot), -1).float()


register(
    EnvSpec(
        name="pendulum",
        factory=PendulumEnv,
        description="Pendulum-v1 (gymnasium dynamics) in torch: Box(1) torque in [-2, 2], obs 3, 200-step limit",
        options={"max_steps": EnvOption(200, "time limit in steps (episode is truncated)")},
        # Reaches greedy return about -150 (random: about -1200) within 500k steps.
        train_defaults={"total_steps": 500_000, "num_envs": 16, "num_steps": 256, "gamma": 0.9, "lr": 1e-3, "num_epochs": 10, "num_minibatches": 16},
    )
)
