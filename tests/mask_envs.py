"""A tiny batched env with a per-step action mask, for the mask tests (`mask_envs:make`).

Two slots; each step every slot gets a fresh random mask (at least one allowed action per slot, per head)
and observes it as floats. The env refuses an action its mask forbids (ActionError) and pays 1 for the
highest allowed action (per head). Episodes last 4 steps. `space`: "discrete" (Discrete(5)), "multi"
(MultiDiscrete((3, 2)): the mask holds 3 + 2 entries) or "box" (Box actions, for the refusal of a mask on
them). `defect` breaks one rule of the mask contract: "shape" (one entry too many), "dtype" (uint8),
"empty" (env 0, slot 1 allowed nothing, or nothing on its second head, from the second step on),
"refuses" (action 0 refused even where the mask allows it), "undeclared" (masks without `action_masks = True`),
"missing" (`action_masks = True` and no mask), "missing_later" and "empty_later" (no mask, or "empty"'s, from the
5th step after a reset on: a contract broken mid-run, after the trainer's first checks; these envs take any action).
"""

from __future__ import annotations

import torch

from phalanx.envs import ActionError, Box, Discrete, MultiDiscrete, StepRecord, VecEnv

SPACES = {"discrete": Discrete(5), "multi": MultiDiscrete((3, 2)), "box": Box.uniform(-1.0, 1.0, (2,))}


class MaskedPick(VecEnv):
    name = "masked_pick"
    num_agents = 2
    action_masks = True

    def __init__(self, num_envs: int = 1, device: str = "cpu", seed: int = 0, space: str = "discrete", defect: str = ""):
        self.num_envs, self.device = num_envs, torch.device(device)
        self.action_space = SPACES[space]
        self.heads = (5,) if space != "multi" else (3, 2)
        self.width = sum(self.heads)
        self.observation_space = Box.uniform(0.0, 1.0, (self.width,))
        self.defect = defect
        self.action_masks = defect != "undeclared"
        self.roles = self.default_roles()
        self._seed_generator(seed)
        self.stepped = False
        self.steps = 0
        self.t = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.mask = torch.ones(num_envs, 2, self.width, dtype=torch.bool, device=self.device)

    def _draw_mask(self) -> None:
        n = self.num_envs
        u = torch.rand(n, 2, self.width, generator=self.gen, device=self.device)
        parts = []
        for part in u.split(self.heads, -1):
            one = torch.nn.functional.one_hot(part.argmax(-1), part.shape[-1]).bool()
            parts.append((part < 0.5) | one)
        self.mask = torch.cat(parts, -1)

    def _record(self, reward: torch.Tensor, done: torch.Tensor, final_obs: torch.Tensor | None = None) -> StepRecord:
        n = self.num_envs
        obs = self.mask.float()
        mask = self.mask.clone()
        if (self.defect == "empty" and self.stepped) or (self.defect == "empty_later" and self.steps >= 5):
            mask[0, 1, 0 if len(self.heads) == 1 else self.heads[0]:] = False
        if self.defect == "shape":
            mask = torch.cat([mask, torch.ones(n, 2, 1, dtype=torch.bool, device=self.device)], -1)
        if self.defect == "dtype":
            mask = mask.to(torch.uint8)
        ended = done[:, None].expand(n, 2)
        false = torch.zeros(n, 2, dtype=torch.bool, device=self.device)
        return StepRecord(obs=obs, reward=reward, terminated=false, truncated=ended.clone(), active=~false,
                          trial_end=false.clone(), final_obs=obs if final_obs is None else final_obs,
                          info={"episode_length": done.float() * 4},
                          action_mask=None if self.defect == "missing" or (self.defect == "missing_later" and self.steps >= 5)
                          else mask)

    def reset(self, seed: int | None = None) -> StepRecord:
        self._seed_generator(seed)
        self.stepped = False
        self.steps = 0
        self.t.zero_()
        self._draw_mask()
        return self._record(torch.zeros(self.num_envs, 2, device=self.device), torch.zeros(self.num_envs, dtype=torch.bool))

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        if isinstance(self.action_space, Box):
            reward = torch.zeros(self.num_envs, 2, device=self.device)
        else:
            picks = actions.reshape(self.num_envs, 2, -1)
            starts = torch.tensor([0, *self.heads[:-1]], device=self.device).cumsum(0)
            allowed = self.mask.gather(-1, picks + starts)
            if not bool(allowed.all()) and not self.defect.endswith("_later"):  # those envs do not refuse
                raise ActionError(f"an action the mask forbids: {picks[~allowed.all(-1)].tolist()}")
            if self.defect == "refuses" and bool((picks == 0).any()):
                raise ActionError("action 0 refused")
            best = torch.stack([m.int().cumsum(-1).argmax(-1) for m in self.mask.split(self.heads, -1)], -1)
            reward = (picks == best).float().mean(-1)
        self.stepped = True
        self.steps += 1
        self.t += 1
        done = self.t >= 4
        before = self.mask.float()
        self.t[done] = 0
        self._draw_mask()
        final = torch.where(done[:, None, None], before, self.mask.float())
        return self._record(reward, done, final)

    def step_state(self) -> dict[str, torch.Tensor]:
        return {"t": self.t, "mask": self.mask}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.t, self.mask = state["t"], state["mask"]


def make(num_envs: int = 1, device: str = "cpu", seed: int = 0, space: str = "discrete", defect: str = "") -> MaskedPick:
    return MaskedPick(num_envs=num_envs, device=device, seed=seed, space=space, defect=defect)
