"""The rollout: the envs in play and `collect`, which plays `num_steps` of every env into the rollout buffer
(buffer.py): each step acts, fills the other slots (teammates, league opponents), steps the envs, writes the
buffer's row and counts the episodes that ended. Each step also writes its bootstrap where the slot was truncated,
V(final_obs), by the boundary table (docs/DESIGN.md section 2); the buffer fills in the rest after the loop.

How the steps run under --compile and --cuda-graphs is graphs.py's; what a step carries over, named for a graph
and for a checkpoint, is run_state.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from phalanx.algo import Normalizers, model_input
from phalanx.buffer import RolloutBuffer, Step
from phalanx.draws import Draws
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.episodes import EpisodeCounters, env_ended
from phalanx.league import League
from phalanx.models.protocol import ActorCritic
from phalanx.profile import PhaseTimer
from phalanx.slots import Teammates

# The feed-forward policy's one call a step: (obs, draws, greedy, critic input) -> (action, log-prob, value).
ActValueFn = Callable[[torch.Tensor, Draws, bool, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _read(flag: torch.Tensor) -> bool:
    """A 0-d bool read on the host: only where `Rollout.host_branches` (the CPU, where it is no device sync)."""
    return bool(flag)


def _read_finite(x: torch.Tensor) -> bool:
    """Whether every element of `x` is finite, read on the host as `_read`: by its sum, finite exactly where
    every element is unless it overflows (then the exact count finds none). One reduction, where
    torch.isfinite is four ops on the CPU."""
    return math.isfinite(x.sum())


# Statistics that start at -1 (none yet) in every collect: where a fault was first seen.
UNSET_STATS = ("env_first_bad_step", "mask_missing_step", "mask_empty_step", "mask_empty_where")


@dataclasses.dataclass(frozen=True)
class StepMode:
    """How a rollout runs its steps, fixed when it is built (build.py, from --compile and --cuda-graphs): eagerly,
    `compiled` whole by torch.compile (with `backend`), `graphed` (recorded once as a CUDA graph, then replayed), or
    both. A captured step reads nothing on the host and keeps its shapes; `static` asks that of an eager step too
    (what a graph records, run where none can be: tests)."""

    compiled: bool = False
    graphed: bool = False
    backend: str = "inductor"
    static: bool = False

    @property
    def captured(self) -> bool:
        return self.compiled or self.graphed

    @property
    def host_free(self) -> bool:
        """The step may not read the host: no branch on what it computed, no shape that depends on values."""
        return self.captured or self.static


@dataclasses.dataclass(frozen=True)
class RolloutParams:
    """What a rollout reads of the run's config: the keys of the same names, whose defaults and meanings config.py
    holds (`config.params_of` fills them)."""

    num_steps: int  # steps of every env a collect plays: the buffer's rows
    obs_clip: float  # the normalised observations' bound (+-)
    team_reward: float  # the weight of the team's mean reward in each slot's learning reward (0: its own alone)
    nonfinite_env: str  # NaN / infinite env values: stop (counted, the trainer stops) or zero (counted and replaced)


class Rollout:
    """Collects `num_steps` of every env on the device; reads nothing back to the host (on CPU, the
    rows truncated at a step are selected, which costs nothing there)."""

    def __init__(self, params: RolloutParams, env: VecEnv, model: ActorCritic, buffer: RolloutBuffer, norms: Normalizers,
                 learner: torch.Tensor, generator: torch.Generator, act_value: ActValueFn | None,
                 amp: Callable[[], AbstractContextManager], timer: PhaseTimer, teammates: Teammates | None = None,
                 league: League | None = None, seed: int | None = None, mode: StepMode = StepMode(),
                 steps: Callable[[Rollout], Steps] | None = None):
        self.params, self.env, self.model, self.norms, self.learner = params, env, model, norms, learner
        self.gen, self.act_value, self.amp, self.timer = generator, act_value, amp, timer
        self.teammates, self.league = teammates, league
        # Where other players fill some slots (league, teammates) and every slot is alike to the model, the learner
        # acts in its own slots only: the others' actions, values and log-probs would be thrown away.
        self.learner_cols = (learner.nonzero().squeeze(1) if act_value is not None and model.slot_agnostic
                             and not model.centralized and not bool(learner.all()) else None)
        self.device = env.device
        self.N, self.A = env.num_envs, env.num_agents
        self.obs_dims = len(env.observation_space.shape)
        self.buffer = buffer
        self.record = env.reset(seed=seed)
        # The observation statistics count the reset observations here and every later one once, as it
        # arrives in `collect` (a rollout starts from the observation the previous one already counted).
        self.obs_in(self.record.obs, fold=self.record.active & learner)
        self.counters = EpisodeCounters(self.N, self.A, self.device)
        # Turn-based (VecEnv.turn_based): a slot's reward, and its episode's end, may come on a turn it sat out;
        # both count for it (the update credits the reward to its last move, algo/gae.py).
        self.turn_based = env.turn_based
        # Slots whose episode ended at the last step: memory (the learner's, a teammate's) resets there.
        self.prev_done = torch.zeros(self.N, self.A, dtype=torch.bool, device=self.device)
        # The learner's memory (empty for a feed-forward model).
        self.memory = model.initial_state(self.N * self.A, self.device)
        # The model's input after the last step (what `value_after` values).
        self.next_obs: torch.Tensor | None = None
        self.mode = mode
        cpu = self.device.type == "cpu"
        # A step compiled for the CPU leaves V(final_obs) to `bootstrap_after`, run after it over the envs truncated at
        # it, as the eager step calls the critic: reading which they are is free there, and the same rows per call
        # give the same bits (the CPU's matrix products round by row count: one call over a rollout's truncated rows
        # after the loop put bootstraps 1e-6 from eager's). In the step, over every env, it was a second transformer
        # forward a step on trial_nav and a fifth of a compiled 4,096-env cartpole collect.
        self.finals_after_step = mode.compiled and not mode.graphed and cpu
        # Which envs' final observations go through the critic in the step: only the truncated ones (the CPU, where
        # reading which they are costs nothing) or all of them (accelerators, a graph: no host sync). Same values.
        self.final_values_whole_batch = not cpu or (mode.host_free and not self.finals_after_step)
        # On the CPU a step may branch on what it computed (reading a value is free there): quiet steps, where
        # no episode ended and every number is finite, skip their bookkeeping. Not in a captured step.
        self.host_branches = cpu and not mode.host_free
        # Sampling draws from `generator` through `draws`, so a captured step can replay them.
        self.draws, self.env_draws = Draws(generator), env.rng
        # Every source of draws a step makes: sampling, and the env where it draws through Draws.
        self.all_draws = [d for d in (self.draws, self.env_draws) if d is not None]
        self.info_keys: list[str] = []
        # The bootstrap placeholder where no slot was truncated (see _collect); never written in place.
        self._no_value = torch.zeros(self.N, self.A, device=self.device)
        # Who acts after a quiet step (StepRecord.quiet: every slot active): the learner's slots, every env.
        self._learner_rows = learner.expand(self.N, self.A)
        # How `collect` runs its steps: one eager `step` after another, or captured (`steps`: graphs.CapturedSteps).
        self.steps = (steps or Steps)(self)

    # -- observations and values -----------------------------------------------------------------
    def obs_in(self, obs: torch.Tensor, fold: torch.Tensor | None = None) -> torch.Tensor:
        """The model's input (`model_input`, as `Policy.preprocess`); `fold` [N, A]: the slots whose
        observations the statistics count first."""
        return model_input(obs, self.obs_dims, self.model.obs_is_image, self.norms.obs, self.params.obs_clip, fold)

    def value(self, obs_n: torch.Tensor, state: torch.Tensor | None, envs: torch.Tensor | None = None) -> torch.Tensor:
        """V of observations of all envs, or of the envs `envs` (a long index) only, in return units."""
        with self.timer.phase("policy_forward"), self.amp():
            if self.model.memory_critic:
                # V from the memory as it stands (e.g. V(final_obs) before the next step's reset); writes nothing.
                memory = self.memory
                if envs is not None:
                    memory = memory.select((envs.unsqueeze(1) * self.A + torch.arange(self.A, device=envs.device)).reshape(-1))
                v = self.model.value_step(obs_n, memory)
            else:
                v = self.model.value(self.critic_in(obs_n, state))
        return self.denorm(v.float())

    def learner_act_value(self, obs_n: torch.Tensor, rec: StepRecord) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The feed-forward learner's (action, log-prob, value) [N, A]: in its own slots (`learner_cols`), zero in the
        others, which their players fill."""
        cols, mask = self.learner_cols, rec.action_mask
        if cols is None:
            return self.act_value(obs_n, self.draws, False, self.critic_in(obs_n, rec.state), mask)
        mine = obs_n.index_select(1, cols)
        action, logp, value = self.act_value(mine, self.draws, False, mine, None if mask is None else mask.index_select(1, cols))
        whole = lambda x: x.new_zeros((self.N, self.A, *x.shape[2:])).index_copy_(1, cols, x)  # noqa: E731
        return whole(action), whole(logp), whole(value)

    def critic_in(self, obs_n: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """What the feed-forward critic reads: the global state (MAPPO) or the observations."""
        return state.reshape(state.shape[0], -1).float() if self.model.centralized else obs_n

    def denorm(self, v: torch.Tensor) -> torch.Tensor:
        return self.norms.value.denormalize(v) if self.norms.value is not None else v

    def final_values(self, rec: StepRecord, next_value: torch.Tensor) -> torch.Tensor:
        """The bootstrap of this step (docs/DESIGN.md section 2, boundary table): V(final_obs) where the slot was truncated,
        else `next_value`, V of the observation that follows, also across a trial end (terminated
        steps ignore it)."""
        trunc, state = rec.truncated, rec.final_state
        if rec.quiet:  # nothing truncated (StepRecord.quiet)
            return next_value
        if not self.final_values_whole_batch:
            if not _read(trunc.any()):
                return next_value
            envs = trunc.any(-1).nonzero().squeeze(1)
            final = self.value(self.obs_in(rec.final_obs[envs]), state[envs] if state is not None else None, envs)
            out = next_value.clone()
            out[envs] = torch.where(trunc[envs], final, next_value[envs])
            return out
        return torch.where(trunc, self.value(self.obs_in(rec.final_obs), state), next_value)

    # -- collect ---------------------------------------------------------------------------------
    @torch.no_grad()
    def collect(self) -> dict[str, torch.Tensor]:
        """`num_steps` of every env into the buffer; -> episode statistics, 0-d tensors.

        Agent episodes are counted per learner slot; team episodes (the env's episode, all slots'
        rewards summed) where every slot is done or was already inactive.
        """
        stats = self.steps.start()
        obs_n = self.obs_in(self.record.obs)
        # The flag and active rows of a quiet step (StepRecord.quiet) are set here and not written again (nor
        # is its bootstrap, filled in after the loop).
        self.buffer.start(self._learner_rows, self.record.obs, self.memory)
        for t in range(self.params.num_steps):
            obs_n = self.steps(t, obs_n, stats)
        self.next_obs = obs_n
        return stats

    def bootstrap_after(self, t: int) -> None:
        """Step t's bootstrap where a slot was truncated, once the step is done: the step itself leaves it out where
        `finals_after_step` (a step compiled for the CPU), and the buffer fills in the rest after the loop."""
        if self.finals_after_step:
            self.buffer.bootstrap_step(t, functools.partial(self.final_values, self.record))

    def new_stats(self) -> dict[str, torch.Tensor]:
        """A collect's episode statistics, zero (`UNSET_STATS` -1: none yet)."""
        zero = lambda: torch.zeros((), device=self.device)  # noqa: E731
        stats = {"ep_return_sum": zero(), "ep_length_sum": zero(), "episodes": zero(), "team_return_sum": zero(),
                 "team_episodes": zero(), "env_nonfinite": zero()}
        stats.update({k: torch.full((), -1.0, device=self.device) for k in UNSET_STATS})
        # The env's info keys, known from its first step, so a captured step sees the same dict every time.
        stats.update({f"info_{k}": zero() for k in self.info_keys})
        return stats

    @torch.no_grad()
    def value_after(self) -> torch.Tensor:
        """V of the observation after the rollout's last step (`RolloutBuffer.bootstrap`)."""
        return self.value(self.next_obs, None if self.model.memory_critic else self.record.state)

    def step(self, t: int | torch.Tensor, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step of every env: act (and value what is acted on), step the envs, write buffers at row `t`,
        count episodes; -> the next observation, model-ready. Captured whole by graphs.CapturedSteps (then `t` is a
        [1] index tensor, so one graph serves every row)."""
        rec, model = self.record, self.model
        learner, counters = self.learner, self.counters
        if model.recurrent:
            with self.timer.phase("policy_forward"), self.amp():
                action, logp, v_mem, self.memory = model.act_step(obs_n, self.memory, self.prev_done, rec.active, self.draws,
                                                                  mask=rec.action_mask)
            logp = logp.float()
            value = self.denorm(v_mem.float()) if model.memory_critic else self.value(obs_n, rec.state)
        else:
            with self.timer.phase("policy_forward"), self.amp():
                action, logp, v = self.learner_act_value(obs_n, rec)
            logp, value = logp.float(), self.denorm(v.float())
        if self.teammates is not None:
            with self.timer.phase("opponents"):
                action = self.teammates.fill(action, rec, self.draws, self.prev_done)
        if self.league is not None:
            with self.timer.phase("opponents"):
                action = self.league.fill(action, rec, self.draws)
        acting = self._learner_rows if rec.quiet else rec.active & learner
        step = Step(acted_on=rec, obs=obs_n, action=action, logprob=logp, value=value, acting=acting,
                    resets=self.prev_done)
        self.buffer.write(t, step)
        prev_active, prev_quiet = rec.active, rec.quiet
        with self.timer.phase("env_step"):
            rec = self._checked(self.env.step(model.head.to_env(action)), t, stats)
        if self.env.action_masks:
            self._check_mask(rec, t, stats)
        next_n = self.obs_in(rec.obs, fold=rec.active & learner if self.norms.obs is not None else None)
        reward = rec.reward
        # A quiet record's flags are all false (StepRecord.quiet): nothing ended, nothing was truncated.
        done = rec.terminated if rec.quiet else rec.terminated | rec.truncated
        # The bootstrap where truncated; the rest is filled in after the loop (see _collect): by the next step's
        # forward (a memory critic's act_step: same memory, no reset where the episode goes on) or one more
        # call, so always when quiet. A captured CPU step leaves it to graphs.CapturedSteps.
        if not (rec.quiet or self.finals_after_step):
            step.bootstrap = self.final_values(rec, self._no_value)  # else `bootstrap_after`, or after the loop
        self.prev_done = done
        # After a quiet record every slot acted.
        counters.add(reward, None if prev_quiet else prev_active, idle_rewards=self.turn_based)
        # The league counts every step; the rest only matters where a slot is done (or a slot left, so an
        # env's episode may have ended): never after two quiet records (every slot active before, none done).
        if self.league is not None or not (rec.quiet and prev_quiet):
            env_done = env_ended(done, prev_active)
            if self.league is not None or not self.host_branches or _read(env_done.any() | done.any()):
                self._count_episodes(rec, done, env_done, acting, stats)
        if self.params.team_reward > 0:
            w = self.params.team_reward
            team = (reward * prev_active).sum(-1, keepdim=True) / prev_active.sum(-1, keepdim=True).clamp_min(1)
            reward = (1 - w) * reward + w * team
        if self.norms.reward is not None:
            reward = self.norms.reward(reward, done, acting)
        step.outcome, step.done, step.reward = rec, done, reward
        self.buffer.write(t, step)
        self.record = rec
        return next_n

    def _count_episodes(self, rec: StepRecord, done: torch.Tensor, env_done: torch.Tensor, acting: torch.Tensor,
                        stats: dict[str, torch.Tensor]) -> None:
        """Fold the episodes that ended at this step into `stats` and restart their counters."""
        counters, learner = self.counters, self.learner
        agent_done = done & (learner if self.turn_based else acting)
        stats["ep_return_sum"] += (counters.slot_return * agent_done).sum()
        stats["ep_length_sum"] += (counters.slot_length * agent_done).sum()
        stats["episodes"] += agent_done.sum()
        stats["team_return_sum"] += (counters.team_return * env_done).sum()
        stats["team_episodes"] += env_done.sum()
        if self.league is not None:
            sides = torch.stack([(counters.slot_return * learner).sum(-1), (counters.slot_return * ~learner).sum(-1)], -1)
            self.league.after_step(rec, env_done, sides, self.draws)
        for k, v in rec.info.items():
            if k in ("episode_return", "episode_length") and k != self.env.success_key:
                continue  # tracked above, per agent slot
            key = f"info_{k}"
            if key not in stats:
                self.info_keys.append(k)
                stats[key] = torch.zeros((), device=self.device)
            stats[key] += (self._learner_mean(v) * env_done).sum()
        counters.end_slots(done)
        counters.end_envs(env_done)

    def _checked(self, rec: StepRecord, t: int | torch.Tensor, stats: dict[str, torch.Tensor]) -> StepRecord:
        """The env boundary: count NaN / infinite observations, states and rewards on the device
        (read with the update's metrics); `nonfinite_env: zero` also replaces them with 0."""
        if rec.finite:  # the env tested it (StepRecord.finite)
            return rec
        image = self.model.obs_is_image  # uint8 pixels cannot be NaN
        numbers = [x for x in (None if image else rec.obs, None if image else rec.final_obs, rec.reward, rec.state,
                               rec.final_state) if x is not None]
        # The quick test looks at each tensor once (a final observation is often the observation itself).
        if self.host_branches and all(_read_finite(x) for x in {id(x): x for x in numbers}.values()):
            return rec
        bad = sum((~torch.isfinite(x)).sum() for x in numbers)
        stats["env_nonfinite"] += bad
        first = stats["env_first_bad_step"]
        first.copy_(torch.where((first < 0) & (bad > 0), t if isinstance(t, int) else t.squeeze(0), first))
        if self.params.nonfinite_env == "zero":
            def zero(x: torch.Tensor | None) -> torch.Tensor | None:
                return None if x is None else torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

            rec = dataclasses.replace(rec, reward=zero(rec.reward), state=zero(rec.state), final_state=zero(rec.final_state),
                                      obs=rec.obs if image else zero(rec.obs),
                                      final_obs=rec.final_obs if image else zero(rec.final_obs))
        return rec

    def _check_mask(self, rec: StepRecord, t: int | torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        """The mask contract mid-run (`check_env` saw the first step only): a record without a mask, or a slot whose
        mask allows nothing, is noted in `stats` (the first step and copy x slot; `Trainer` reads them after the
        collect, before any update trains on such a step)."""
        step = t if isinstance(t, int) else t.squeeze(0)
        if rec.action_mask is None:
            missing = stats["mask_missing_step"]
            missing.copy_(torch.where(missing < 0, step, missing))
            return
        empty = self.env.action_space.allows_nothing(rec.action_mask).flatten()
        first, where = stats["mask_empty_step"], stats["mask_empty_where"]
        fresh = (first < 0) & empty.any()
        where.copy_(torch.where(fresh, empty.float().argmax().float(), where))
        first.copy_(torch.where(fresh, step, first))

    def _learner_mean(self, v: torch.Tensor) -> torch.Tensor:
        """An info value per env [N]: per-slot values [N, A] averaged over the learner's slots."""
        v = v.float().reshape(self.N, -1)
        if v.shape[1] == self.A and self.A > 1:
            return (v * self.learner).sum(-1) / self.learner.sum()
        return v.mean(-1)

    def every_step_active(self, trained: torch.Tensor) -> bool:
        """Whether every learner slot trains on every step of the last rollout (`trained`, from
        `advantages`), read on the host as `_read` (call it only where `host_branches`)."""
        return _read(trained.all())

    def acts_after(self) -> torch.Tensor:
        """[N, A] bool: the learner slots that act right after the rollout (what bootstraps its last steps)."""
        return self.record.active & self.learner


class Steps:
    """How `Rollout.collect` runs its steps: one eager `Rollout.step` after another (graphs.CapturedSteps
    captures them under --compile and --cuda-graphs)."""

    def __init__(self, rollout: Rollout):
        self.rollout = rollout

    def start(self) -> dict[str, torch.Tensor]:
        """A collect begins: -> the statistics its steps add into."""
        return self.rollout.new_stats()

    def __call__(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.rollout.step(t, obs_n, stats)
        self.rollout.bootstrap_after(t)
        return out

    def forget(self) -> None:
        """The rollout's step state was replaced (a restore): nothing recorded may read the old tensors."""
