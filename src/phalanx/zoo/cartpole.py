"""CartPole-v1 as a batched torch environment, matching gymnasium's dynamics step for step."""

from __future__ import annotations

import math

import torch

from phalanx.envs import draw
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.registry import EnvOption, EnvSpec, register
from phalanx.envs.spaces import Box, Discrete

GRAVITY = 9.8
MASSCART = 1.0
MASSPOLE = 0.1
TOTAL_MASS = MASSPOLE + MASSCART
LENGTH = 0.5  # half the pole's length
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG = 10.0
TAU = 0.02
THETA_THRESHOLD = 12 * 2 * math.pi / 360
X_THRESHOLD = 2.4


def cartpole_dynamics(state: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One euler step of gymnasium's CartPole. state [N, 4] (x, x_dot, theta, theta_dot), action [N].

    Returns (next_state [N, 4], terminated [N] bool).
    """
    x, x_dot, theta, theta_dot = state.unbind(-1)
    force = torch.where(action == 1, FORCE_MAG, -FORCE_MAG).to(state.dtype)
    costheta, sintheta = torch.cos(theta), torch.sin(theta)
    # Same operation order as gymnasium so float64 results agree to the last bits.
    temp = (force + POLEMASS_LENGTH * theta_dot.square() * sintheta) / TOTAL_MASS
    thetaacc = (GRAVITY * sintheta - costheta * temp) / (
        LENGTH * (4.0 / 3.0 - MASSPOLE * costheta.square() / TOTAL_MASS)
    )
    xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
    nxt = torch.stack(
        (x + TAU * x_dot, x_dot + TAU * xacc, theta + TAU * theta_dot, theta_dot + TAU * thetaacc), -1
    )
    terminated = (nxt[:, 0].abs() > X_THRESHOLD) | (nxt[:, 2].abs() > THETA_THRESHOLD)
    return nxt, terminated


class ClassicEnv(VecEnv):
    """Shared machinery of the single-agent classic-control envs (cartpole, pendulum).

    The physics state is float64 (as in gymnasium) so trajectories match gymnasium's; observations
    are float32. The time limit mirrors gymnasium's TimeLimit wrapper: `truncated` is set whenever the
    step count reaches `max_steps`, even on a step that also terminates (both flags True then).
    Every step draws a fresh start state for every env, used only where an episode ended, so the
    RNG stream does not depend on which envs finished (and nothing syncs with the host).
    """

    state_dim: int
    capturable = True

    def __init__(self, num_envs: int, device: torch.device | str, seed: int | None, max_steps: int) -> None:
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.max_steps = int(max_steps)
        self.roles = self.default_roles()
        self._seed_generator(seed)
        self.physics_state = self._sample_start()
        self.elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.ep_return = torch.zeros(num_envs, dtype=torch.float32, device=self.device)

    # --- subclass hooks ---
    def _sample_start(self) -> torch.Tensor:
        raise NotImplementedError

    def _transition(self, state: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(next_state, reward [N] float32, terminated [N] bool)."""
        raise NotImplementedError

    def _observe(self, state: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # --- protocol ---
    def _record(self, obs, final_obs, reward, terminated, truncated, info) -> StepRecord:
        n = self.num_envs
        return StepRecord(
            obs=obs.unsqueeze(1),
            reward=reward.unsqueeze(1),
            terminated=terminated.unsqueeze(1),
            truncated=truncated.unsqueeze(1),
            active=torch.ones(n, 1, dtype=torch.bool, device=self.device),
            trial_end=torch.zeros(n, 1, dtype=torch.bool, device=self.device),
            final_obs=final_obs.unsqueeze(1),
            info=info,
        )

    def reset(self, seed: int | None = None) -> StepRecord:
        self._seed_generator(seed)
        self.physics_state = self._sample_start()
        self.elapsed.zero_()
        self.ep_return.zero_()
        obs = self._observe(self.physics_state)
        false = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        zero = torch.zeros(self.num_envs, dtype=torch.float32, device=self.device)
        return self._record(obs, obs, zero, false, false, {})

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        nxt, reward, terminated = self._transition(self.physics_state, actions.to(self.device))
        self.elapsed += 1
        self.ep_return += reward
        truncated = self.elapsed >= self.max_steps
        done = terminated | truncated
        final_obs = self._observe(nxt)
        self.physics_state = torch.where(done.unsqueeze(1), self._sample_start(), nxt)
        obs = torch.where(done.unsqueeze(1), self._observe(self.physics_state), final_obs)
        info = {
            "episode_return": torch.where(done, self.ep_return, 0.0),
            "episode_length": torch.where(done, self.elapsed, 0).float(),
        }
        self.elapsed = torch.where(done, 0, self.elapsed)
        self.ep_return = torch.where(done, 0.0, self.ep_return)
        return self._record(obs, final_obs, reward, terminated, truncated, info)

    def set_physics_state(self, state: torch.Tensor, elapsed: torch.Tensor | None = None) -> None:
        """Overwrite the physics state [N, state_dim] (and optionally the step counters [N])."""
        self.physics_state = state.to(device=self.device, dtype=torch.float64).reshape(self.num_envs, self.state_dim).clone()
        if elapsed is not None:
            self.elapsed = elapsed.to(device=self.device, dtype=torch.long).reshape(self.num_envs).clone()

    def step_state(self) -> dict[str, torch.Tensor]:
        return {"physics_state": self.physics_state, "elapsed": self.elapsed, "ep_return": self.ep_return}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.physics_state, self.elapsed, self.ep_return = state["physics_state"], state["elapsed"], state["ep_return"]


class CartPoleEnv(ClassicEnv):
    """gymnasium CartPole-v1: push the cart left (0) or right (1); reward 1 per step, 500-step limit."""

    name = "cartpole"
    renders = True
    state_dim = 4
    observation_space = Box(
        low=(-X_THRESHOLD * 2, -math.inf, -THETA_THRESHOLD * 2, -math.inf),
        high=(X_THRESHOLD * 2, math.inf, THETA_THRESHOLD * 2, math.inf),
        shape=(4,),
    )
    action_space = Discrete(2)

    def __init__(self, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0, max_steps: int = 500) -> None:
        super().__init__(num_envs, device, seed, max_steps)

    def _sample_start(self) -> torch.Tensor:
        u = self.rng.rand((self.num_envs, 4), self.device, torch.float64)
        return u * 0.1 - 0.05

    def _transition(self, state, actions):
        nxt, terminated = cartpole_dynamics(state, actions.reshape(self.num_envs))
        return nxt, torch.ones(self.num_envs, dtype=torch.float32, device=self.device), terminated

    def _observe(self, state: torch.Tensor) -> torch.Tensor:
        return state.float()

    def render(self, env_index: int = 0) -> torch.Tensor:
        """Side view of env `env_index`'s cart and pole: uint8 [200, 320, 3] on the CPU.

        The track spans 1.2 x the +-2.4 termination bounds (red ticks); the bar at the bottom is
        the time used of the step limit."""
        w, h, track_y = 320, 200, 150.0
        scale = w / (2 * X_THRESHOLD * 1.2)
        x, _, theta, _ = self.physics_state[env_index].tolist()
        img = draw.canvas(h, w, (255, 255, 255))
        draw.fill_rect(img, 0, track_y, w, track_y + 2, (40, 40, 40))
        for side in (-1, 1):
            tx = w / 2 + side * X_THRESHOLD * scale
            draw.fill_rect(img, tx - 1, track_y - 10, tx + 1, track_y + 10, (210, 50, 50))
        cx = w / 2 + x * scale
        cart_w, cart_h = 0.5 * scale, 0.3 * scale
        draw.fill_rect(img, cx - cart_w / 2, track_y - cart_h, cx + cart_w / 2, track_y, (30, 30, 30))
        axle_y = track_y - cart_h
        pole = 2 * LENGTH * scale
        tip_x, tip_y = cx + pole * math.sin(theta), axle_y - pole * math.cos(theta)
        draw.draw_line(img, cx, axle_y, tip_x, tip_y, (202, 152, 101), width=0.12 * scale)
        draw.fill_circle(img, cx, axle_y, 0.05 * scale, (129, 132, 203))
        frac = float(self.elapsed[env_index]) / self.max_steps
        draw.bar(img, 10, h - 14, w - 10, h - 8, frac, (90, 150, 220), back=(225, 225, 225))
        return draw.to_tensor(img)


register(
    EnvSpec(
        name="cartpole",
        gymnasium_id="CartPole-v1",
        factory=CartPoleEnv,
        description="CartPole-v1 (gymnasium dynamics) in torch: Discrete(2), obs 4, 500-step limit",
        options={"max_steps": EnvOption(500, "time limit in steps (episode is truncated)", min=1)},
        # Tuned to reach greedy return 475+ within 200k steps on 2 CPU cores in well under 20 s.
        train_defaults={"total_steps": 200_000, "num_envs": 32, "num_steps": 64, "lr": 2e-3, "num_epochs": 8, "num_minibatches": 4, "gae_lambda": 0.98},
    )
)
