"""Envs for the env-contract tests: one that keeps every rule, and one per rule that breaks it.

Each broken env is also a plugin factory (`--env tests.contract_envs:<name>`), so the command line can
be shown to refuse it with one line.
"""

from __future__ import annotations

import dataclasses

import torch

from phalanx.envs import Box, Discrete, StepRecord, VecEnv, generator_state, set_generator_state


class GoodEnv(VecEnv):
    """Two slots walking on a line of 9 cells towards cell 4; an episode ends where both stand on it
    (terminated) or after 6 steps (truncated)."""

    name = "good"
    num_agents = 2
    role_names = ("a", "b")
    observation_space = Box.uniform(-1.0, 1.0, (2,))
    action_space = Discrete(3)
    state_space = Box.uniform(0.0, 1.0, (2,))

    def __init__(self, num_envs: int = 4, device: torch.device | str = "cpu", seed: int | None = 0):
        self.num_envs, self.device = num_envs, torch.device(device)
        self.roles = torch.tensor([0, 1], device=self.device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed or 0)
        self.pos = torch.zeros(num_envs, 2, dtype=torch.long, device=self.device)
        self.t = torch.zeros(num_envs, dtype=torch.long, device=self.device)

    def obs(self) -> torch.Tensor:
        return torch.stack([self.pos.float() / 8 * 2 - 1, (self.pos.flip(-1) - self.pos).float() / 8], -1)

    def state(self) -> torch.Tensor:
        return self.pos.float() / 8

    def starts(self) -> torch.Tensor:
        return torch.randint(0, 9, (self.num_envs, 2), generator=self.gen, device=self.device)

    def record(self, reward, terminated, truncated, final_obs, final_state, active=None) -> StepRecord:
        n = self.num_envs
        active = torch.ones(n, 2, dtype=torch.bool, device=self.device) if active is None else active
        return StepRecord(obs=self.obs(), reward=reward, terminated=terminated, truncated=truncated, active=active,
                          trial_end=torch.zeros(n, 2, dtype=torch.bool, device=self.device), final_obs=final_obs,
                          state=self.state(), final_state=final_state, info={"at_goal": (self.pos == 4).float().mean(-1)})

    def reset(self, seed: int | None = None) -> StepRecord:
        if seed is not None:
            self.gen.manual_seed(seed)
        self.pos, self.t = self.starts(), torch.zeros_like(self.t)
        z = torch.zeros(self.num_envs, 2, device=self.device)
        return self.record(z, z.bool(), z.bool(), self.obs(), self.state())

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        pos = (self.pos + actions - 1).clamp(0, 8)
        self.t += 1
        goal = (pos == 4).all(-1)
        timeout = (self.t >= 6) & ~goal
        reward = (pos == 4).float()
        self.pos = pos
        final_obs, final_state = self.obs(), self.state()
        done = goal | timeout
        self.pos = torch.where(done.unsqueeze(1), self.starts(), pos)
        self.t = torch.where(done, 0, self.t)
        both = lambda x: x.unsqueeze(1).expand(-1, 2).contiguous()  # noqa: E731
        return self.record(reward, both(goal), both(timeout), final_obs, final_state)

    def step_state(self) -> dict[str, torch.Tensor]:
        return {"pos": self.pos, "t": self.t}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.pos, self.t = state["pos"], state["t"]


def good(num_envs: int = 4, device: torch.device | str = "cpu", seed: int | None = 0, goal: int = 4) -> GoodEnv:
    """A contract-keeping two-slot env (plugin factory)."""
    return GoodEnv(num_envs, device, seed)


# --- one broken rule each ---------------------------------------------------------------------------
class RewardPerEnv(GoodEnv):
    def step(self, actions):
        rec = super().step(actions)
        rec.reward = rec.reward.sum(-1)  # [N], not [N, A]
        return rec


class FloatTerminated(GoodEnv):
    def step(self, actions):
        rec = super().step(actions)
        rec.terminated = rec.terminated.float()
        return rec


class GymTuple(GoodEnv):
    def step(self, actions):
        rec = super().step(actions)
        return rec.obs, rec.reward, rec.terminated, rec.truncated, rec.info


class Float64Obs(GoodEnv):
    def obs(self):
        return super().obs().double()


class GymnasiumSpace(GoodEnv):
    """A gymnasium Box where a phalanx.envs one belongs: both classes are called Box."""

    def __init__(self, *args, **kwargs):
        import gymnasium

        super().__init__(*args, **kwargs)
        self.observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,))


class MissingRoles(GoodEnv):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        del self.roles


class NoStateDict(GoodEnv):
    step_state = VecEnv.step_state
    load_step_state = VecEnv.load_step_state


class CapturableWithoutStepState(NoStateDict):
    capturable = True

    def state_dict(self):
        return {"pos": self.pos.clone(), "t": self.t.clone(), "rng": generator_state(self.gen)}

    def load_state_dict(self, state):
        self.pos, self.t = state["pos"].clone(), state["t"].clone()
        set_generator_state(self.gen, state["rng"])


class StepStateGrows(GoodEnv):
    """Keeps a trail of positions that grows every step: a replayed step could not write it back."""

    capturable = True

    def reset(self, seed=None):
        rec = super().reset(seed)
        self.trail = self.pos.clone()
        return rec

    def step(self, actions):
        rec = super().step(actions)
        self.trail = torch.cat([self.trail, self.pos], 1)
        return rec

    def step_state(self):
        return {**super().step_state(), "trail": self.trail}

    def load_step_state(self, state):
        super().load_step_state(state)
        self.trail = state["trail"]


class FinalObsWithoutBoundary(GoodEnv):
    def step(self, actions):
        rec = super().step(actions)
        rec.final_obs = rec.final_obs + 0.5
        return rec


class FinalObsAfterReset(GoodEnv):
    """The classic auto-reset bug: the final observation is read after the reset."""

    def step(self, actions):
        rec = super().step(actions)
        rec.final_obs = rec.obs
        return rec


class ObsOutOfBox(GoodEnv):
    def obs(self):
        return super().obs() * 3  # declared Box(-1, 1)


class LateNaN(GoodEnv):
    """Turns NaN after 30 steps: a quick check of one step cannot see it."""

    calls = 0

    def step(self, actions):
        rec = super().step(actions)
        self.calls += 1
        if self.calls > 30:
            rec.reward = torch.full_like(rec.reward, float("nan"))
        return rec


class RewardWhileInactive(GoodEnv):
    def record(self, reward, terminated, truncated, final_obs, final_state, active=None):
        active = torch.ones(self.num_envs, 2, dtype=torch.bool, device=self.device)
        active[:, 1] = False  # slot 1 never acts, yet is paid
        return super().record(reward, terminated & active, truncated & active, final_obs, final_state, active)


class AcceptsAnyAction(GoodEnv):
    def step(self, actions):
        return super().step(actions.long().clamp(0, 2))


class GlobalRandom(GoodEnv):
    def starts(self):
        return torch.randint(0, 9, (self.num_envs, 2), device=self.device)  # the global RNG: not seeded by reset


class ForgetsGenerator(GoodEnv):
    def state_dict(self):
        return {"pos": self.pos.clone(), "t": self.t.clone()}

    def load_state_dict(self, state):
        self.pos, self.t = state["pos"].clone(), state["t"].clone()


class StateMissing(GoodEnv):
    def state(self):
        return None


class InfoScalar(GoodEnv):
    def record(self, *args, **kwargs):
        rec = super().record(*args, **kwargs)
        rec.info["at_goal"] = rec.info["at_goal"].mean()
        return rec


class DoneAtReset(GoodEnv):
    def reset(self, seed=None):
        rec = super().reset(seed)
        rec.terminated = torch.ones_like(rec.terminated)
        return rec


class ObsOnAnotherDevice(GoodEnv):
    def obs(self):
        return super().obs().to("meta")  # any device but env.device


class RoleOutOfRange(GoodEnv):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.roles = torch.tensor([0, 2], device=self.device)


class RaisesMidRun(GoodEnv):
    """Keeps every rule, then its own step raises at call `crash_at` (a user's bug that shows up mid-run)."""

    def __init__(self, num_envs: int = 4, device: torch.device | str = "cpu", seed: int | None = 0, crash_at: int = 500):
        super().__init__(num_envs, device, seed)
        self.crash_at, self.calls = crash_at, 0

    def step(self, actions):
        self.calls += 1
        if self.calls == self.crash_at:
            raise ValueError(f"cell index {self.calls} out of range\nsecond line of the message")
        return super().step(actions)


def raises_mid_run(num_envs: int = 4, device: torch.device | str = "cpu", seed: int | None = 0,
                   crash_at: int = 500) -> RaisesMidRun:
    return RaisesMidRun(num_envs, device, seed, crash_at)


class Stacked(VecEnv):
    """GoodEnv's observations as a stack of the last 3 on each slot's first axis (frame_stack = 3), oldest first;
    3 copies of the first observation where an episode starts."""

    name = "good"
    num_agents = 2
    role_names = ("a", "b")
    frame_stack = 3
    observation_space = Box.uniform(-1.0, 1.0, (3, 2))
    action_space = Discrete(3)
    state_space = Box.uniform(0.0, 1.0, (2,))

    def __init__(self, num_envs: int = 4, device: torch.device | str = "cpu", seed: int | None = 0):
        self.inner = GoodEnv(num_envs, device, seed)
        self.num_envs, self.device, self.roles, self.gen = num_envs, self.inner.device, self.inner.roles, self.inner.gen
        self.stack = torch.zeros(num_envs, 2, 3, 2, device=self.device)

    def starts(self, frame: torch.Tensor) -> torch.Tensor:
        return frame.unsqueeze(2).expand(-1, -1, 3, -1)

    def reset(self, seed: int | None = None) -> StepRecord:
        rec = self.inner.reset(seed)
        self.stack = self.starts(rec.obs).clone()
        return dataclasses.replace(rec, obs=self.stack.clone(), final_obs=self.stack.clone())

    def step(self, actions: torch.Tensor) -> StepRecord:
        rec = self.inner.step(actions)
        final = self.moved(self.stack, rec.final_obs)
        fresh = rec.terminated | rec.truncated
        self.stack = torch.where(fresh[..., None, None], self.starts(rec.obs), final)
        return dataclasses.replace(rec, obs=self.stack.clone(), final_obs=final)

    def moved(self, stack: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
        return torch.cat([stack[:, :, 1:], frame.unsqueeze(2)], 2)

    def step_state(self) -> dict[str, torch.Tensor]:
        return {"stack": self.stack, **{f"inner.{k}": v for k, v in self.inner.step_state().items()}}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.stack = state["stack"]
        self.inner.load_step_state({k[6:]: v for k, v in state.items() if k.startswith("inner.")})


class StackNotMoved(Stacked):
    def moved(self, stack, frame):
        return self.starts(frame)  # copies of the newest frame every step: nothing moves


class StackFirstAxisWrong(Stacked):
    observation_space = Box.uniform(-1.0, 1.0, (2, 3))


# (env class, what the one-line message says)
BROKEN = {
    "reward_per_env": (RewardPerEnv, "step() record.reward must have shape [4, 2]; got [4]"),
    "float_terminated": (FloatTerminated, "step() record.terminated must be bool; got float32"),
    "gym_tuple": (GymTuple, "step() must return a phalanx.envs.StepRecord; got tuple (a gym-style tuple?"),
    "float64_obs": (Float64Obs, "reset() record.obs must be float32; got float64"),
    "gymnasium_space": (GymnasiumSpace, "observation_space must be a phalanx.envs space (Box); got gymnasium.spaces.box.Box "
                                        "(gymnasium's: make it phalanx.envs.Box"),
    "missing_roles": (MissingRoles, "roles must be a long tensor [num_agents] of role indices"),
    "no_state_dict": (NoStateDict, "state_dict() is not implemented"),
    "capturable_without_step_state": (CapturableWithoutStepState, "step_state() is not implemented: a capturable env names"),
    "step_state_grows": (StepStateGrows, "step_state() must keep its names, shapes and dtypes from step to step; "
                                         "'trail' was int64 [4, 2] and is int64 [4, 4] after step 0"),
    "final_obs_without_boundary": (FinalObsWithoutBoundary, "record.final_obs must equal obs where no episode or trial ended"),
    "final_obs_after_reset": (FinalObsAfterReset, "step() record.final_obs equals obs (the next episode's first observation) "
                                                  "at every one of"),
    "obs_out_of_box": (ObsOutOfBox, "step() record.obs leaves observation_space Box"),
    "late_nan": (LateNaN, "step() record.reward holds NaN or infinite values at step"),
    "reward_while_inactive": (RewardWhileInactive, "record.reward must be 0 for slots that were inactive before the step"),
    "accepts_any_action": (AcceptsAnyAction, "step() accepted action 3 (out of range) for Discrete(3)"),
    "global_random": (GlobalRandom, "reset(seed=7) must be deterministic"),
    "forgets_generator": (ForgetsGenerator, "load_state_dict(state_dict()) must restore the env"),
    "state_missing": (StateMissing, "reset() record.state must be a tensor float32 [4, 2]; got NoneType"),
    "info_scalar": (InfoScalar, "reset() record.info['at_goal'] must be a tensor [num_envs=4]"),
    "done_at_reset": (DoneAtReset, "reset() record.terminated / truncated must be all False"),
    "role_out_of_range": (RoleOutOfRange, "roles must index role_names (0..1); got [0, 2]"),
    "obs_on_another_device": (ObsOnAnotherDevice, "reset() record.obs must be on cpu; got meta"),
    "stack_not_moved": (StackNotMoved, "step() record.obs breaks frame_stack = 3 at step 0 (env 0, slot 0): a stack "
                                       "that goes on must drop its oldest frame and append one new frame"),
    "stack_first_axis_wrong": (StackFirstAxisWrong, "frame_stack = 3 needs observations [3, *frame] per slot (the stack "
                                                    "first); observation_space has shape [2, 3]"),
}

# Plugin factories of the broken envs (`--env tests.contract_envs:<name>`).
for _name, (_cls, _) in BROKEN.items():
    globals()[_name] = (lambda cls: lambda num_envs=4, device="cpu", seed=0: cls(num_envs, device, seed))(_cls)
