"""Pendulum-v1 as a batched torch environment, matching gymnasium's dynamics step for step."""

from __future__ import annotations

import math

import torch

from phalanx.envs import draw
from phalanx.envs.registry import EnvOption, EnvSpec, register
from phalanx.envs.spaces import Box
from phalanx.zoo.cartpole import ClassicEnv

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
    renders = True
    state_dim = 2
    observation_space = Box(low=(-1.0, -1.0, -MAX_SPEED), high=(1.0, 1.0, MAX_SPEED), shape=(3,))
    action_space = Box.uniform(-MAX_TORQUE, MAX_TORQUE, (1,))

    def __init__(self, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0, max_steps: int = 200) -> None:
        super().__init__(num_envs, device, seed, max_steps)

    def _sample_start(self) -> torch.Tensor:
        u = self.rng.rand((self.num_envs, 2), self.device, torch.float64) * 2 - 1
        return torch.stack((u[:, 0] * math.pi, u[:, 1]), -1)

    def _transition(self, state, actions):
        nxt, reward = pendulum_dynamics(state, actions.reshape(self.num_envs))
        terminated = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return nxt, reward.float(), terminated

    def _observe(self, state: torch.Tensor) -> torch.Tensor:
        th, thdot = state.unbind(-1)
        return torch.stack((torch.cos(th), torch.sin(th), thdot), -1).float()

    def render(self, env_index: int = 0) -> torch.Tensor:
        """Env `env_index`'s pendulum: uint8 [200, 200, 3] on the CPU.

        The rod hangs from the centre (theta = 0 points up; positive theta is counter-clockwise, as in
        gymnasium); the signed bar below it is the angular velocity (full at +-8), the thin bar at the
        bottom the time used of the step limit."""
        size, cx, cy, rod = 200, 100.0, 90.0, 70.0
        th, thdot = self.physics_state[env_index].tolist()
        img = draw.canvas(size, size, (255, 255, 255))
        draw.ring(img, cx, cy, rod + 6, (225, 225, 225), width=1.0)
        tip_x, tip_y = cx - rod * math.sin(th), cy - rod * math.cos(th)
        draw.draw_line(img, cx, cy, tip_x, tip_y, (204, 77, 77), width=12.0)
        draw.fill_circle(img, cx, cy, 4.0, (30, 30, 30))
        draw.fill_rect(img, 20, 176, 180, 184, (225, 225, 225))
        speed = max(-1.0, min(1.0, thdot / MAX_SPEED))
        draw.fill_rect(img, cx, 176, cx + 80 * speed, 184, (90, 150, 220))
        draw.fill_rect(img, cx - 0.5, 174, cx + 0.5, 186, (30, 30, 30))
        frac = float(self.elapsed[env_index]) / self.max_steps
        draw.bar(img, 20, 192, 180, 195, frac, (150, 150, 150), back=(235, 235, 235))
        return draw.to_tensor(img)


register(
    EnvSpec(
        name="pendulum",
        gymnasium_id="Pendulum-v1",
        factory=PendulumEnv,
        description="Pendulum-v1 (gymnasium dynamics) in torch: Box(1) torque in [-2, 2], obs 3, 200-step limit",
        options={"max_steps": EnvOption(200, "time limit in steps (episode is truncated)", min=1)},
        # Reaches greedy return about -150 (random: about -1200) within 500k steps.
        train_defaults={"total_steps": 500_000, "num_envs": 16, "num_steps": 256, "gamma": 0.9, "lr": 1e-3, "num_epochs": 10, "num_minibatches": 16},
    )
)
