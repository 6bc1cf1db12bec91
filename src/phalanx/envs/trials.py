"""Multi-trial episodes (docs/DESIGN.md section 2, `trial_end`): `MultiTrialEnv` wraps a seedable env.

An episode of `k` trials (1..8) replays one world `k` times: the wrapper draws one seed per episode
per env and, at every trial start, re-creates the world from that seed, so every trial of an episode
starts from the bit-identical world; only the agents' memory (the trainer's business: it is *not*
reset at `trial_end`) differs between trials.

The inner env protocol (`TrialWorld`), beyond the VecEnv attributes (num_envs, num_agents, device,
a 1-D Box observation_space, action_space, optional 1-D Box state_space, roles, role_names,
scripted_names / scripted_actions, state_dict / load_state_dict):

* `reset_envs(mask [N] bool, seeds [N] int64) -> (obs [N, A, D], state [N, S] or None)`: re-create
  the world of the masked envs from their seeds (the same seed gives the bit-identical world,
  whatever the other envs, the call history or the generators hold), every slot active again there;
  other envs are untouched. Returns the current observation (and state) of *every* env.
* `step(actions) -> StepRecord`: one step, with no auto-reset and no time limit of its own.
  `terminated | truncated` on a slot that was active says the slot finished its trial at this step
  (reached its goal, died, left); from then on the inner env ignores its actions, pays it nothing
  and reports it inactive until the next `reset_envs`. `info["trial_success"]` ([N, A] bool), when
  present, says which finishing slots succeeded; without it, a `terminated` slot succeeded.

Flags the wrapper returns (every tensor [N, A], one per learner slot):

* a slot that finishes mid-trial gets that step's reward and is then parked: `active` False until
  the trial ends. In trials 0..k-2 it is *not* flagged `terminated`: its episode goes on in the
  next trial. In the k-th (last) trial its finishing step is its last active step of the episode,
  so it is flagged `terminated` there, as StepRecord asks of a slot's own end (no bootstrap from
  the parked observation, whose value is never trained; its agent episode is counted with its
  return), and not again when the trial ends (flags describe the slots active before a step: the env
  contract; `phalanx check-env trial_nav --steps 300` once failed on it).
* the trial ends when every slot is parked, or when `max_trial_steps` (L) steps have passed; then
  `trial_end` is True for every slot, `final_obs` / `final_state` hold the last observation of the
  trial, and `obs` is the first observation of the next trial (the same world again, every slot
  active).
* at the end of the k-th trial `trial_end` is True for every slot and `terminated` for every slot active
  before the step (the episode
  has a fixed horizon of at most k * L steps and the observation carries the trial index and the
  time in the trial, so this is a true termination, not a truncation); a new episode seed is drawn.
  `truncated` is always False.
* parked slots get reward 0 (the wrapper masks the inner reward with the slots active before the step).

Observation per slot: the inner observation, then the trial index one-hot (k), the time in the trial
`t / L` (0 at the trial start), and whether this slot has succeeded in the current trial. A slot that
succeeds stays active for one more "acknowledge" step (its action is ignored by the inner env, its
reward is 0) whose observation shows it on the goal with that bit set, and is parked after it: a
memory model writes nothing on inactive steps, so without that step it would never see the outcome
of its own trial. The bit is cleared at every trial start, so a memoryless policy learns nothing
from it about earlier trials (an earlier version carried "succeeded in the previous trial" into
the next trial, which let an MLP adapt across one trial without any memory).
Global state (when the inner env has one): the inner state, the trial one-hot and the time fraction.

info ([N] float32 each, set where the episode ended at this step, 0 elsewhere):
`trial_{i}_score` (i < k: the fraction of slots that succeeded in trial i),
`ada_delta_trial_{i}_minus_0` (1 <= i < k: trial_i_score - trial_0_score),
`goal_reached` (the mean of the trial scores: success rate over slots and trials; the `success_key`),
`trials_completed` (trials that ended because every slot was parked, 0..k),
`timed_out` (trials that ended at the timeout, k - trials_completed),
`mean_trial_length` (mean steps per trial).

Seeds are drawn for every env at every step (used only where an episode ended), so the RNG stream
does not depend on which envs finished, and nothing syncs with the host.
"""

from __future__ import annotations

from typing import Protocol

import torch

from phalanx.draws import Source
from phalanx.envs import draw
from phalanx.envs.base import StepRecord, VecEnv, generator_state, set_generator_state
from phalanx.envs.spaces import Box
from phalanx.errors import ConfigError

MAX_TRIALS = 8
SEED_HIGH = 2**62  # episode seeds are drawn uniformly from [0, 2**62)


class TrialWorld(Protocol):
    """The inner env protocol of `MultiTrialEnv` (see the module docstring)."""

    num_envs: int
    num_agents: int
    device: torch.device
    renders: bool

    def render(self, env_index: int = 0) -> torch.Tensor: ...

    def reset_envs(self, mask: torch.Tensor, seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def step(self, actions: torch.Tensor) -> StepRecord: ...


class MultiTrialEnv(VecEnv):
    """k trials of one seeded world per episode; the flags and metrics are in the module docstring."""

    def __init__(
        self,
        inner: VecEnv,
        trials: int = 4,
        max_trial_steps: int = 10,
        seed: int | None = 0,
        name: str | None = None,
    ) -> None:
        if not callable(getattr(inner, "reset_envs", None)):
            raise ConfigError(f"MultiTrialEnv needs an inner env with reset_envs(mask, seeds); {type(inner).__name__} has none")
        if isinstance(trials, bool) or not isinstance(trials, int) or not 1 <= trials <= MAX_TRIALS:
            raise ConfigError(f"trials must be an integer in 1..{MAX_TRIALS}, got {trials!r}")
        if isinstance(max_trial_steps, bool) or not isinstance(max_trial_steps, int) or max_trial_steps < 1:
            raise ConfigError(f"max_trial_steps must be a positive integer, got {max_trial_steps!r}")
        space = inner.observation_space
        if not isinstance(space, Box) or len(space.shape) != 1:
            raise ConfigError(f"MultiTrialEnv needs a 1-D Box observation space, got {space.describe()}")
        self.inner = inner
        self.name = name or f"{inner.name}_trials"
        self.num_envs = inner.num_envs
        self.num_agents = inner.num_agents
        self.device = inner.device
        self.trials = trials
        self.max_trial_steps = max_trial_steps
        self.action_space = inner.action_space
        self.role_names = inner.role_names
        self.roles = inner.roles
        self.scripted_names = tuple(inner.scripted_names)
        self.success_key = "goal_reached"
        k = trials
        extra = k + 2
        self.observation_space = Box(
            space.low + (0.0,) * extra, space.high + (1.0,) * extra, (space.shape[0] + extra,), space.dtype
        )
        ss = inner.state_space
        if ss is not None:
            if not isinstance(ss, Box) or len(ss.shape) != 1:
                raise ConfigError(f"MultiTrialEnv needs a 1-D Box state space, got {ss.describe()}")
            self.state_space = Box(ss.low + (0.0,) * (k + 1), ss.high + (1.0,) * (k + 1), (ss.shape[0] + k + 1,), ss.dtype)
        else:
            self.state_space = None
        dev = self.device
        self._trial_ids = torch.arange(k, device=dev)
        self._seed_generator(seed)
        self._reset_all()

    # --- internals --------------------------------------------------------------------------------
    def _draw_seeds(self) -> torch.Tensor:
        return self.rng.randint(0, SEED_HIGH, (self.num_envs,), self.device)

    def _reset_all(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, a, k, dev = self.num_envs, self.num_agents, self.trials, self.device
        self.episode_seed = self._draw_seeds()
        self.trial = torch.zeros(n, dtype=torch.long, device=dev)
        self.trial_step = torch.zeros(n, dtype=torch.long, device=dev)
        self.active = torch.ones(n, a, dtype=torch.bool, device=dev)
        self.reached = torch.zeros(n, a, dtype=torch.bool, device=dev)  # succeeded in the current trial
        self.ack = torch.zeros(n, a, dtype=torch.bool, device=dev)  # finished last step: acknowledge, then park
        self.scores = torch.zeros(n, k, dtype=torch.float32, device=dev)
        self.completed = torch.zeros(n, dtype=torch.float32, device=dev)
        self.length_sum = torch.zeros(n, dtype=torch.float32, device=dev)
        return self.inner.reset_envs(torch.ones(n, dtype=torch.bool, device=dev), self.episode_seed)

    def _augment(self, obs: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, a, k = self.num_envs, self.num_agents, self.trials
        onehot = (self.trial.unsqueeze(1) == self._trial_ids).float()  # [N, k]
        frac = (self.trial_step.float() / self.max_trial_steps).unsqueeze(1)  # [N, 1]
        o = torch.cat(
            (obs.float(), onehot.unsqueeze(1).expand(n, a, k), frac.unsqueeze(1).expand(n, a, 1), self.reached.float().unsqueeze(2)),
            2,
        )
        s = None if state is None else torch.cat((state.float(), onehot, frac), 1)
        return o, s

    def _info(self, ended: torch.Tensor) -> dict[str, torch.Tensor]:
        k = self.trials
        info: dict[str, torch.Tensor] = {}
        for i in range(k):
            info[f"trial_{i}_score"] = torch.where(ended, self.scores[:, i], 0.0)
        for i in range(1, k):
            info[f"ada_delta_trial_{i}_minus_0"] = torch.where(ended, self.scores[:, i] - self.scores[:, 0], 0.0)
        info["goal_reached"] = torch.where(ended, self.scores.mean(1), 0.0)
        info["trials_completed"] = torch.where(ended, self.completed, 0.0)
        info["timed_out"] = torch.where(ended, k - self.completed, 0.0)
        info["mean_trial_length"] = torch.where(ended, self.length_sum / k, 0.0)
        return info

    # --- protocol ---------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> StepRecord:
        self._seed_generator(seed)
        current = self._reset_all()
        n, a, dev = self.num_envs, self.num_agents, self.device
        obs, state = self._augment(*current)
        false = torch.zeros(n, a, dtype=torch.bool, device=dev)
        return StepRecord(
            obs=obs, reward=torch.zeros(n, a, dtype=torch.float32, device=dev), terminated=false,
            truncated=false.clone(), active=self.active.clone(), trial_end=false.clone(), final_obs=obs,
            state=state, final_state=state, info=self._info(torch.zeros(n, dtype=torch.bool, device=dev)),
        )

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents)
        n, a, k, dev = self.num_envs, self.num_agents, self.trials, self.device
        prev_active = self.active
        rec = self.inner.step(actions)
        reward = torch.where(prev_active, rec.reward.float(), 0.0)
        finished = (rec.terminated | rec.truncated) & prev_active
        success = rec.info.get("trial_success")
        success = (rec.terminated if success is None else success.bool()) & finished
        self.reached = self.reached | success
        self.trial_step = self.trial_step + 1
        # A slot that finished this step stays active one more step to observe its success; one that
        # was acknowledging is parked now.
        active = prev_active & ~self.ack & (rec.active | finished)
        all_parked = ~active.any(1)
        timeout = self.trial_step >= self.max_trial_steps
        trial_end = all_parked | timeout  # [N]
        last_trial = self.trial == k - 1
        episode_end = trial_end & last_trial

        # Per-trial bookkeeping where the trial ended.
        slot_score = self.reached.float().mean(1)  # [N]
        here = trial_end.unsqueeze(1) & (self.trial.unsqueeze(1) == self._trial_ids)  # [N, k]
        self.scores = torch.where(here, slot_score.unsqueeze(1), self.scores)
        self.completed = self.completed + (trial_end & all_parked).float()
        self.length_sum = self.length_sum + torch.where(trial_end, self.trial_step.float(), 0.0)
        final_obs, final_state = self._augment(rec.obs, rec.state)
        info = self._info(episode_end)

        # Next trial (same seed) or next episode (fresh seed) where the trial ended.
        fresh = self._draw_seeds()
        self.episode_seed = torch.where(episode_end, fresh, self.episode_seed)
        current = self.inner.reset_envs(trial_end, self.episode_seed)
        te1 = trial_end.unsqueeze(1)
        ee1 = episode_end.unsqueeze(1)
        was_ack = self.ack
        self.ack = finished & ~te1
        self.reached = self.reached & ~te1
        self.active = active | te1
        self.trial = torch.where(trial_end, torch.where(episode_end, 0, self.trial + 1), self.trial)
        self.trial_step = torch.where(trial_end, 0, self.trial_step)
        self.scores = torch.where(ee1, 0.0, self.scores)
        self.completed = torch.where(episode_end, 0.0, self.completed)
        self.length_sum = torch.where(episode_end, 0.0, self.length_sum)
        obs, state = self._augment(*current)
        return StepRecord(
            obs=obs, reward=reward, terminated=(ee1 & prev_active) | (was_ack & last_trial.unsqueeze(1)),
            truncated=torch.zeros(n, a, dtype=torch.bool, device=dev), active=self.active.clone(),
            trial_end=te1.expand(n, a).contiguous(), final_obs=final_obs, state=state, final_state=final_state,
            info=info,
        )

    def scripted_actions(self, name: str, record: StepRecord, draws: Source) -> torch.Tensor:
        return self.inner.scripted_actions(name, record, draws)

    def step_state(self) -> dict[str, torch.Tensor]:
        out = {"episode_seed": self.episode_seed, "trial": self.trial, "trial_step": self.trial_step, "active": self.active,
               "reached": self.reached, "ack": self.ack, "scores": self.scores, "completed": self.completed,
               "length_sum": self.length_sum}
        out.update({f"inner.{k}": v for k, v in self.inner.step_state().items()})
        return out

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_step_state({k[6:]: v for k, v in state.items() if k.startswith("inner.")})
        self.episode_seed, self.trial, self.trial_step = state["episode_seed"], state["trial"], state["trial_step"]
        self.active, self.reached, self.ack = state["active"], state["reached"], state["ack"]
        self.scores, self.completed, self.length_sum = state["scores"], state["completed"], state["length_sum"]

    # The inner world's own checkpoint (its generator's state too, where it has one) under 'inner.'.
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {
            "episode_seed": self.episode_seed.clone(),
            "trial": self.trial.clone(),
            "trial_step": self.trial_step.clone(),
            "active": self.active.clone(),
            "reached": self.reached.clone(),
            "ack": self.ack.clone(),
            "scores": self.scores.clone(),
            "completed": self.completed.clone(),
            "length_sum": self.length_sum.clone(),
            "rng": generator_state(self.gen),
        }
        for key, value in self.inner.state_dict().items():
            out[f"inner.{key}"] = value
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        n, a, k, dev = self.num_envs, self.num_agents, self.trials, self.device
        self.inner.load_state_dict({key[6:]: v for key, v in state.items() if key.startswith("inner.")})
        self.episode_seed = state["episode_seed"].to(device=dev, dtype=torch.long).reshape(n).clone()
        self.trial = state["trial"].to(device=dev, dtype=torch.long).reshape(n).clone()
        self.trial_step = state["trial_step"].to(device=dev, dtype=torch.long).reshape(n).clone()
        self.active = state["active"].to(device=dev, dtype=torch.bool).reshape(n, a).clone()
        self.reached = state["reached"].to(device=dev, dtype=torch.bool).reshape(n, a).clone()
        self.ack = state["ack"].to(device=dev, dtype=torch.bool).reshape(n, a).clone()
        self.scores = state["scores"].to(device=dev, dtype=torch.float32).reshape(n, k).clone()
        self.completed = state["completed"].to(device=dev, dtype=torch.float32).reshape(n).clone()
        self.length_sum = state["length_sum"].to(device=dev, dtype=torch.float32).reshape(n).clone()
        set_generator_state(self.gen, state["rng"])

    @property
    def renders(self) -> bool:  # type: ignore[override]
        return self.inner.renders

    def close(self) -> None:
        self.inner.close()

    def render(self, env_index: int = 0) -> torch.Tensor:
        """The inner env's `render(env_index)` with a 20-px strip below it: one box per trial, past
        trials shaded red (no slot succeeded) to green (all did), the current one outlined with the
        time used of `max_trial_steps`, later ones grey. uint8 [H + 20, W, 3] on the CPU."""
        if not self.inner.renders:
            raise NotImplementedError(f"{type(self.inner).__name__} cannot render")
        top = self.inner.render(env_index).cpu()
        w = top.shape[1]
        strip = draw.canvas(20, w, (250, 250, 250))
        k, cur = self.trials, int(self.trial[env_index])
        scores = self.scores[env_index].tolist()
        frac = float(self.trial_step[env_index]) / self.max_trial_steps
        box = (w - 4) / k
        for i in range(k):
            x0, x1 = 2 + i * box + 1, 2 + (i + 1) * box - 1
            if i < cur:
                draw.fill_rect(strip, x0, 4, x1, 16, draw.mix((210, 70, 60), (70, 180, 80), scores[i]))
            elif i == cur:
                draw.bar(strip, x0, 4, x1, 16, frac, (90, 150, 220), back=(225, 225, 225))
                draw.outline_rect(strip, x0, 4, x1, 16, (30, 30, 30))
            else:
                draw.fill_rect(strip, x0, 4, x1, 16, (200, 200, 200))
        return torch.cat((top, draw.to_tensor(strip)), 0)
