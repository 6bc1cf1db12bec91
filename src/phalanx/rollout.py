"""The rollout: buffers on the device, the envs in play, and `collect` (docs/DESIGN.md section 2).

The buffer owns what is known at collection time, including each step's bootstrap value
(`next_values`) by the one rule of the boundary table (docs/DESIGN.md section 2), and computes advantages from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from phalanx.algo import GAEParams, Normalizers, PPOBatch, advantages
from phalanx.algo.normalize import model_input
from phalanx.budget import buffer_specs, stored_stack
from phalanx.checkpoint import section
from phalanx.config import Config, params_of
from phalanx.draws import Draws
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.episodes import EpisodeCounters, env_ended, stack_restarts
from phalanx.errors import ConfigError
from phalanx.graphs import check_graphs, fold, own_memory, warm_stream
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


class Rollout:
    """Collects `num_steps` of every env on the device; reads nothing back to the host (on CPU, the
    rows truncated at a step are selected, which costs nothing there)."""

    def __init__(self, cfg: Config, env: VecEnv, model: ActorCritic, norms: Normalizers, learner: torch.Tensor,
                 generator: torch.Generator, act_value: ActValueFn | None, amp: Callable[[], AbstractContextManager],
                 timer: PhaseTimer, teammates: Teammates | None = None, league: League | None = None,
                 seed: int | None = None):
        self.cfg, self.env, self.model, self.norms, self.learner = cfg, env, model, norms, learner
        self.gen, self.act_value, self.amp, self.timer = generator, act_value, amp, timer
        self.teammates, self.league = teammates, league
        self.device = env.device
        self.N, self.A = env.num_envs, env.num_agents
        self.obs_dims = len(env.observation_space.shape)
        # Sized before the env was built (budget.run_bytes, checked when the run is built).
        self.buf = {k: torch.zeros(shape, dtype=dt, device=self.device) for k, (shape, dt) in buffer_specs(cfg, env, model).items()}
        self.frame_stack = stored_stack(env, model)
        # Every buffer's rows as views, made once: an eager step's write is one copy, not an index and a copy.
        self._rows = {k: v.unbind(0) for k, v in self.buf.items()}
        self.record = env.reset(seed=seed)
        # The observation statistics count the reset observations here and every later one once, as it
        # arrives in `collect` (a rollout starts from the observation the previous one already counted).
        self.obs_in(self.record.obs, fold=self.record.active & learner)
        self.counters = EpisodeCounters(self.N, self.A, self.device)
        # Slots whose episode ended at the last step: memory (the learner's, a teammate's) resets there.
        self.prev_done = torch.zeros(self.N, self.A, dtype=torch.bool, device=self.device)
        # The learner's memory (empty for a feed-forward model), and as it was at this rollout's start.
        self.memory = model.initial_state(self.N * self.A, self.device)
        self.segment_start = self.memory.clone()
        # Which envs' final observations go through the critic: only the truncated ones (CPU, where
        # reading which they are costs nothing) or all of them (accelerators: no host sync). Same values.
        self.final_values_whole_batch = self.device.type != "cpu"
        # On the CPU a step may branch on what it computed (reading a value is free there): quiet steps, where
        # no episode ended and every number is finite, skip their bookkeeping. Not in a captured step.
        self.host_branches = self.device.type == "cpu"
        # Sampling draws from `generator` through `draws`, so a captured step can replay them.
        self.draws, self.env_draws = Draws(generator), env.rng
        # Every source of draws a step makes: sampling, and the env where it draws through Draws.
        self.all_draws = [d for d in (self.draws, self.env_draws) if d is not None]
        self.info_keys: list[str] = []
        # The bootstrap placeholder where no slot was truncated (see _collect); never written in place.
        self._no_value = torch.zeros(self.N, self.A, device=self.device)
        # Who acts after a quiet step (StepRecord.quiet: every slot active): the learner's slots, every env.
        self._learner_rows = learner.expand(self.N, self.A)
        self._captured: Callable | None = None
        # How `collect` runs a step, chosen once: eagerly, captured (`capture`) or as a CUDA graph (`use_cuda_graphs`).
        self._drive: Callable[[int, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor] = self._eager_step
        self._finals_after_step = False  # a captured CPU step leaves V(final_obs) to `_compiled_step`
        self._planned = False
        self._graphed = False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._warm_steps = 0
        self._stats: dict[str, torch.Tensor] | None = None

    @property
    def capturable(self) -> bool:
        """Whether `capture` can take the whole step: an env that declares it (every model, teammates and
        league opponents included: they draw through `draws`, write memory in place, and a captured league
        runs every player of its fixed layout)."""
        return self.env.capturable

    def compile(self, backend: str = "inductor") -> None:
        """--compile: the whole step captured where `capturable`, else the policy's act_value compiled alone."""
        if self.capturable:
            self.capture(backend)
        elif self.act_value is not None:
            self.act_value = torch.compile(self.act_value, dynamic=False, backend=backend)

    def capture(self, backend: str = "inductor") -> None:
        """Compile the rollout step whole (torch.compile fullgraph: a graph break raises). Its first call
        runs eagerly and notes the random draws a step makes; later calls replay them in the graph."""
        if not self.capturable:
            raise ValueError("this rollout step cannot be captured whole (see Rollout.capturable)")
        self.static_step()
        if self.device.type == "cpu":
            # ... except on the CPU, where reading which slots were truncated is free: V(final_obs) runs after
            # each captured step, over the envs truncated at it, as the eager step calls the critic. The same
            # rows per call give the same bits (the CPU's matrix products round by row count: valuing every
            # step's truncated rows in one call after the loop put bootstraps 1e-6 from eager's). In the step,
            # over every env, it was a second transformer forward a step on trial_nav and a fifth of a
            # compiled 4096-env cartpole collect.
            self.final_values_whole_batch, self._finals_after_step = False, True
        self._t_index = [torch.tensor([t], device=self.device) for t in range(self.cfg.num_steps)]
        self._captured = torch.compile(self._step, fullgraph=True, dynamic=False, backend=backend)
        self._planned = False
        if not self._graphed:
            self._drive = self._compiled_step

    def use_cuda_graphs(self) -> None:
        """--cuda-graphs: after one eager step that notes the random draws and two warm-up steps, one step
        is recorded as a CUDA graph (phalanx.graphs) and every later step replays it."""
        if not self.capturable:
            raise ConfigError("config key 'cuda_graphs' needs an env that declares capturable = True")
        check_graphs(self.device)
        try:
            self.env.step_state()
        except NotImplementedError:
            raise ConfigError(f"config key 'cuda_graphs' needs an env that names its step state (step_state and "
                              f"load_step_state, docs/ENVIRONMENTS.md); env '{self.env.name}' does not") from None
        self.static_step()
        self._graphed = True
        self._drive = self._graph_step

    def static_step(self) -> None:
        """The step a graph takes: no host reads, no shape that depends on values. The critic runs over every
        final observation (selecting the truncated rows is a host read), no quiet-step shortcut, and the
        league runs every player over every env."""
        self.final_values_whole_batch = True
        self.host_branches = False
        if self.league is not None:
            self.league.select_rows = False

    # -- observations and values -----------------------------------------------------------------
    def obs_in(self, obs: torch.Tensor, fold: torch.Tensor | None = None) -> torch.Tensor:
        """The model's input (`model_input`, as `Policy.preprocess`); `fold` [N, A]: the slots whose
        observations the statistics count first."""
        return model_input(obs, self.obs_dims, self.model.obs_is_image, self.norms.obs, self.cfg.obs_clip, fold)

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
        """One rollout of `num_steps` on the device; returns episode statistics as 0-d tensors.

        Agent episodes are counted per learner slot; team episodes (the env's episode, all slots'
        rewards summed) where every slot is done or was already inactive.
        """
        with self.timer.phase("collect"):
            return self._collect()

    def _new_stats(self) -> dict[str, torch.Tensor]:
        if self._graphed and self._stats is not None:  # a CUDA graph adds into the tensors it was recorded with
            for v in self._stats.values():
                v.zero_()
            self._stats["env_first_bad_step"].fill_(-1.0)
            return self._stats
        zero = lambda: torch.zeros((), device=self.device)  # noqa: E731
        stats = {"ep_return_sum": zero(), "ep_length_sum": zero(), "episodes": zero(), "team_return_sum": zero(),
                 "team_episodes": zero(), "env_nonfinite": zero(), "env_first_bad_step": torch.full((), -1.0, device=self.device)}
        # The env's info keys, known from its first step, so a captured step sees the same dict every time.
        stats.update({f"info_{k}": zero() for k in self.info_keys})
        if self._graphed:
            self._stats = stats
        return stats

    def _collect(self) -> dict[str, torch.Tensor]:
        b, model = self.buf, self.model
        stats = self._new_stats()
        obs_n = self.obs_in(self.record.obs)
        # The flag and active rows of a quiet step (StepRecord.quiet) are these and are not written again
        # (nor is its bootstrap, filled in after the loop): five writes fewer a step (#27).
        for name in ("terminated", "truncated", "trial_end"):
            b[name].zero_()
        b["active"].copy_(self._learner_rows)
        if self.frame_stack:  # the older frames of the first observation; each step stores its newest
            b["frames"][: self.frame_stack - 1].copy_(self.record.obs.movedim(2, 0)[: self.frame_stack - 1])
        self.segment_start = self.memory.clone()
        if self.league is not None and self._graph is not None and self._graph_layout != self.league.layout:
            self._graph, self._warm_steps = None, 0  # the league's bank grew: record the step again
        for t in range(self.cfg.num_steps):
            obs_n = self._drive(t, obs_n, stats)
        # What follows step t (unless truncated there) is the observation step t+1 valued in its one
        # forward: the same input, so the same value as a critic call after the env step, one call fewer a
        # step. After the last step one more call values what follows it.
        nv = b["next_values"]
        nv[-1] = torch.where(b["truncated"][-1], nv[-1], self.value(obs_n, None if model.memory_critic else self.record.state))
        nv[:-1] = torch.where(b["truncated"][:-1], nv[:-1], b["values"][1:])
        return stats

    def _draw_contexts(self, mode: str, queues: list[list[torch.Tensor]] | None = None) -> contextlib.ExitStack:
        """The policy's and the env's draws in one mode: 'recording', 'ahead' or 'replaying' (from `queues`)."""
        stack = contextlib.ExitStack()
        for i, d in enumerate(self.all_draws):
            stack.enter_context(d.recording() if mode == "recording" else d.ahead() if mode == "ahead" else d.replaying(queues[i]))
        return stack

    def _note_draws(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        """The plan of draws a step makes (phalanx.draws), noted by one eager step whose every effect is then
        undone: the step state, normalisers, the league's game counts and the generators are put back as they
        were (the buffers' row `t` is written again by the step that follows). So every step after a start or a
        resume runs captured, and a resumed --compile run follows the uninterrupted one bit for bit."""
        record, state = self.record, {k: v.clone() for k, v in self.step_state(stats).items()}
        norms = {k: v.clone() for k, v in self.norms.state_dict().items()}
        counts = self.league.counts.clone() if self.league is not None else None
        generators = [d.generator.get_state() for d in self.all_draws]
        with self._draw_contexts("recording"):
            self._step(t, obs_n, stats)
        for key in stats.keys() - section(state, "stats").keys():
            stats[key].zero_()  # an info key first seen in the noted step: counted from the step that follows
        self.record = record
        self.load_step_state(state, stats)
        self.norms.load_state_dict(norms)
        if counts is not None:
            self.league.counts.copy_(counts)
        for d, g in zip(self.all_draws, generators):
            d.generator.set_state(g)
        self._planned = True

    def _eager_step(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._step(t, obs_n, stats)

    def _compiled_step(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step under --compile: the captured step, replaying the noted plan of draws."""
        if not self._planned:
            self._note_draws(t, obs_n, stats)
        with self._draw_contexts("ahead"):
            obs_n = self._captured(self._t_index[t], obs_n, stats)
        if self._finals_after_step:
            nv = self._rows["next_values"][t]
            nv.copy_(self.final_values(self.record, nv))
        return obs_n

    def _graph_step(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step under --cuda-graphs: eager (or compiled) until the graph is recorded, then a replay."""
        step = self._captured or self._step
        if self._graph is None:
            if not self._planned:
                self._note_draws(t, obs_n, stats)
            if self._warm_steps < 2:
                self._warm_steps += 1
                side = warm_stream(self.device)
                with torch.cuda.stream(side), self._draw_contexts("ahead"):
                    out = step(self._t_index[t] if self._captured else t, obs_n, stats)
                torch.cuda.current_stream(self.device).wait_stream(side)
                return out
            self._record_graph(step, obs_n, stats)
        if obs_n is not self._graph_obs:
            self._graph_obs.copy_(obs_n)
        self._graph_t.fill_(t)
        for d, queue in zip(self.all_draws, self._graph_queues):
            d.refill(queue)
        self._graph.replay()
        return self._graph_obs

    def _record_graph(self, step: Callable, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        self._graph_t = torch.zeros(1, dtype=torch.long, device=self.device)
        self._graph_queues = [d.buffers() for d in self.all_draws]
        self._graph_layout = self.league.layout if self.league is not None else 0
        recorded = self._own_step_state(obs_n.clone(), stats)
        graph = torch.cuda.CUDAGraph()
        with self._draw_contexts("replaying", self._graph_queues), torch.cuda.graph(graph):
            self._graph_obs = self._folded_step(step, self._graph_t, recorded, stats)
        self._graph = graph

    def _own_step_state(self, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step state (`step_state`, and the step's input observation as 'obs_n'), each tensor in memory of
        its own (graphs.own_memory), handed back to its holders: what a recorded step reads and writes."""
        recorded = own_memory({**self.step_state(stats), "obs_n": obs_n})
        self.load_step_state(recorded, stats)
        return recorded

    def _folded_step(self, step: Callable, t: int | torch.Tensor, recorded: dict[str, torch.Tensor],
                     stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step from `recorded` (`_own_step_state`) that leaves its new state in those same tensors
        (graphs.fold) and hands them back: the body of a recorded CUDA graph. -> the next observation."""
        obs_n = step(t, recorded["obs_n"], stats)
        fold(recorded, {**self.step_state(stats), "obs_n": obs_n})
        self.load_step_state(recorded, stats)
        return recorded["obs_n"]

    def _step(self, t: int | torch.Tensor, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step of every env: act (and value what is acted on), step the envs, write buffers at row `t`,
        count episodes; -> the next observation, model-ready. Captured whole by `capture` (then `t` is a
        [1] index tensor, so one graph serves every row)."""
        rec, cfg, model = self.record, self.cfg, self.model
        learner, counters = self.learner, self.counters
        if model.recurrent:
            self._write("resets", t, self.prev_done)
            self._write("env_active", t, rec.active)
            with self.timer.phase("policy_forward"), self.amp():
                action, logp, v_mem, self.memory = model.act_step(obs_n, self.memory, self.prev_done, rec.active, self.draws)
            logp = logp.float()
            value = self.denorm(v_mem.float()) if model.memory_critic else self.value(obs_n, rec.state)
        else:
            with self.timer.phase("policy_forward"), self.amp():
                action, logp, v = self.act_value(obs_n, self.draws, False, self.critic_in(obs_n, rec.state))
            logp, value = logp.float(), self.denorm(v.float())
        if self.teammates is not None:
            with self.timer.phase("opponents"):
                action = self.teammates.fill(action, rec, self.draws, self.prev_done)
        if self.league is not None:
            with self.timer.phase("opponents"):
                action = self.league.fill(action, rec, self.draws)
        acting = self._learner_rows if rec.quiet else rec.active & learner
        if self.frame_stack:
            self._write_frame(t, obs_n[:, :, -1])
        else:
            self._write("obs", t, obs_n)
        if "states" in self.buf:
            self._write("states", t, rec.state.reshape(self.N, -1))
        self._write("actions", t, action)
        self._write("logprobs", t, logp)
        self._write("values", t, value)
        if not rec.quiet:
            self._write("active", t, acting)
        prev_active, prev_quiet = rec.active, rec.quiet
        with self.timer.phase("env_step"):
            rec = self._checked(self.env.step(model.head.to_env(action)), t, stats)
        next_n = self.obs_in(rec.obs, fold=rec.active & learner if self.norms.obs is not None else None)
        reward = rec.reward
        # A quiet record's flags are all false (StepRecord.quiet): nothing ended, nothing was truncated.
        done = rec.terminated if rec.quiet else rec.terminated | rec.truncated
        # The bootstrap where truncated; the rest is filled in after the loop (see _collect): by the next step's
        # forward (a memory critic's act_step: same memory, no reset where the episode goes on) or one more
        # call, so always when quiet. A captured CPU step leaves it to `_compiled_step`.
        if not (rec.quiet or self._finals_after_step):
            self._write("next_values", t, self.final_values(rec, self._no_value))
        self.prev_done = done
        if self.frame_stack:
            self._write("stack_restarts", t, stack_restarts(done, rec.trial_end, prev_active))
        counters.add(reward, None if prev_quiet else prev_active)  # after a quiet record every slot acted
        # The league counts every step; the rest only matters where a slot is done (or a slot left, so an
        # env's episode may have ended): never after two quiet records (every slot active before, none done).
        if self.league is not None or not (rec.quiet and prev_quiet):
            env_done = env_ended(done, prev_active)
            if self.league is not None or not self.host_branches or _read(env_done.any() | done.any()):
                self._count_episodes(rec, done, env_done, acting, stats)
        if cfg.team_reward > 0:
            w = cfg.team_reward
            team = (reward * prev_active).sum(-1, keepdim=True) / prev_active.sum(-1, keepdim=True).clamp_min(1)
            reward = (1 - w) * reward + w * team
        if self.norms.reward is not None:
            reward = self.norms.reward(reward, done, acting)
        self._write("rewards", t, reward)
        if not rec.quiet:
            self._write("terminated", t, rec.terminated)
            self._write("truncated", t, rec.truncated)
            self._write("trial_end", t, rec.trial_end)
        self.record = rec
        return next_n

    def _count_episodes(self, rec: StepRecord, done: torch.Tensor, env_done: torch.Tensor, acting: torch.Tensor,
                        stats: dict[str, torch.Tensor]) -> None:
        """Fold the episodes that ended at this step into `stats` and restart their counters."""
        counters, learner = self.counters, self.learner
        agent_done = done & acting
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

    def _write(self, name: str, t: int | torch.Tensor, x: torch.Tensor) -> None:
        if isinstance(t, int):
            self._rows[name][t].copy_(x)
        else:  # a tensor row index: one graph for every row (an int would be specialised per row)
            buf = self.buf[name]
            buf.index_copy_(0, t, x.to(buf.dtype).unsqueeze(0))

    def _write_frame(self, t: int | torch.Tensor, frame: torch.Tensor) -> None:
        """The newest frame of step t's observation, in frames row t + S - 1 (see `frame_index`)."""
        if isinstance(t, int):
            self._rows["frames"][t + self.frame_stack - 1].copy_(frame)
        else:
            self.buf["frames"].index_copy_(0, t + (self.frame_stack - 1), frame.unsqueeze(0))

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
        if self.cfg.nonfinite_env == "zero":
            def zero(x: torch.Tensor | None) -> torch.Tensor | None:
                return None if x is None else torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

            rec = dataclasses.replace(rec, reward=zero(rec.reward), state=zero(rec.state), final_state=zero(rec.final_state),
                                      obs=rec.obs if image else zero(rec.obs),
                                      final_obs=rec.final_obs if image else zero(rec.final_obs))
        return rec

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

    # -- advantages ------------------------------------------------------------------------------
    def advantages(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(advantages, returns, trained) [T, N, A] of the last rollout (`algo.update.advantages`)."""
        return advantages(self.buf, self.acts_after(), params_of(GAEParams, self.cfg))

    def acts_after(self) -> torch.Tensor:
        """[N, A] bool: the learner slots that act right after the rollout (what bootstraps its last steps)."""
        return self.record.active & self.learner

    # -- state -----------------------------------------------------------------------------------
    def step_state(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor a rollout step reads and may replace, by name (phalanx.graphs): the env's
        `step_state`, the record acted on, the slots' pending resets, episode counters, the learner's,
        teammates' and league players' memories, the league's assignments and the collect's `stats`.
        Buffers, parameters and normalisers are written in place."""
        out = {f"env.{k}": v for k, v in self.env.step_state().items()}
        out.update({f"record.{k}": v for k, v in self.record.tensors().items()})
        out.update({f"counters.{k}": v for k, v in self.counters.state_tensors().items()})
        out["prev_done"] = self.prev_done
        out.update({f"memory.{k}": v for k, v in self.memory.tensors().items()})
        if self.teammates is not None:
            out.update({f"teammates.{k}": v for k, v in self.teammates.plan.step_state().items()})
        if self.league is not None:
            out.update({f"league.{k}": v for k, v in self.league.step_state().items()})
        out.update({f"stats.{k}": v for k, v in stats.items()})
        return out

    def load_step_state(self, state: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
        """Take `state` (the names of `step_state`) as the rollout's own tensors, as they are."""
        self.env.load_step_state(section(state, "env"))
        self.record = self.record.with_tensors(section(state, "record"))
        self.counters.load_state(section(state, "counters"))
        self.prev_done = state["prev_done"]
        self.memory = type(self.memory).of(section(state, "memory"))
        if self.teammates is not None:
            self.teammates.plan.load_step_state(section(state, "teammates"))
        if self.league is not None:
            self.league.load_step_state(section(state, "league"))
        stats.update(section(state, "stats"))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The envs in play, their records, episode counters and memory (keys as checkpoints store them)."""
        out = {f"env.{k}": v for k, v in self.env.state_dict().items()}
        rec = self.record
        out["record.obs"], out["record.active"] = rec.obs, rec.active
        if rec.state is not None:
            out["record.state"] = rec.state
        out.update({f"trainer.{k}": v for k, v in self.counters.state_tensors().items()})
        out["trainer.prev_done"] = self.prev_done
        out.update({f"memory.{k}": v for k, v in self.memory.tensors().items()})
        return out

    def load_state(self, tensors: dict[str, torch.Tensor], section: Callable[[str], dict[str, torch.Tensor]]) -> None:
        dev = self.device
        # A recorded CUDA graph reads the tensors it was recorded with; restoring replaces them.
        self._graph, self._warm_steps = None, 0
        self.env.load_state_dict(section("env"))
        rec = self.record
        rec.obs = tensors["record.obs"].to(dev)
        rec.active = tensors["record.active"].to(dev)
        if "record.state" in tensors:
            rec.state = tensors["record.state"].to(dev)
        self.counters.load_state(section("trainer"))
        if "trainer.prev_done" in tensors:  # older checkpoints of memoryless runs lack it (it resets teammates' memory)
            self.prev_done = tensors["trainer.prev_done"].to(dev)
        self.memory = type(self.memory).of({k: v.to(dev) for k, v in section("memory").items()})


class BatchEvaluator:
    """A minibatch of the rollout's samples through the current model -> (log-prob, entropy, value), float32 (the
    losses' dtype): feed-forward models in one forward; memory models replay each segment from the memory stored
    at the rollout's start (`Rollout.segment_start`), read at each call."""

    def __init__(self, model: ActorCritic, amp: Callable[[], AbstractContextManager], rollout: Rollout):
        self.model, self.amp, self.rollout = model, amp, rollout

    def __call__(self, part: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with self.amp():
            if self.model.recurrent:
                logp, ent, value = self.sequence(part)
            else:
                logp, ent, value = self.model.evaluate_value(part.obs, part.actions, part.critic_obs)
        return logp.float(), ent.float(), value.float()  # the losses stay in float32

    def sequence(self, part: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        A, device = self.rollout.A, self.rollout.device
        slots = (part.rows.unsqueeze(1) * A + torch.arange(A, device=device)).reshape(-1)
        start = self.rollout.segment_start.select(slots)
        logp, ent, value = self.model.evaluate_seq(part.obs, part.actions, start, part.resets, part.env_active,
                                                   idle_outputs=False)
        if value is None:  # memoryless critic: the global state [B, T, S] -> [B, T, A] -> [B, A, T]
            value = self.model.value(part.critic_obs).transpose(-1, -2) if self.model.centralized else self.model.value(part.critic_obs)
        return logp, ent, value
