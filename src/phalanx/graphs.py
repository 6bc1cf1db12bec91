"""The rollout step and the minibatch update step, captured: under --compile the rollout step is compiled
whole; under --cuda-graphs each is recorded once as a CUDA graph and replayed, so each costs one launch instead
of hundreds of small ones (`CapturedSteps` runs the rollout's steps in the mode it was built with, `step_mode`;
`GraphedStep` the update's).

A graph replays the kernels of one recorded call on the same memory. An eager step becomes
replayable when (1) what it reads arrives at fixed addresses: the caller copies fresh inputs (the
minibatch's rows, the rollout's batch, the random draws) into static buffers before each replay, and
(2) the state it carries to the next call comes back to those addresses. The rollout step's state is
named, by contract, as one flat dict of tensors (`run_state.step_state`: the env's `step_state`, the
records, counters, memories and league assignments); a step may replace those tensors rather than
write them in place (`self.x = torch.where(...)`). Before recording, `own_memory` gives every entry
memory of its own; at the end of the recorded step, inside the graph, `fold` copies the new values
into the recorded tensors, and the caller puts them back (`run_state.load_step_state`). Every replay then
reads and writes the same memory, as the eager loop would. Modules' parameters and buffers are written in
place by contract (optimizer, normalisers), so they are not part of the state.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from phalanx.algo.ppo import PPOBatch
from phalanx.checkpoint import section
from phalanx.envs.base import VecEnv
from phalanx.errors import ConfigError
from phalanx.rollout import UNSET_STATS, Rollout, StepMode, Steps
from phalanx.run_state import load_step_state, step_state


def own_memory(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` where no two entries share memory (an env returning its own buffer as `obs`, a final
    observation that is the observation, a broadcast view): each such entry becomes a copy, so folding
    one cannot overwrite another. Entries already alone are kept as they are."""
    out, seen = {}, set()
    for name, x in state.items():
        ptr = x.untyped_storage().data_ptr()
        overlaps = any(s == 0 and n > 1 for s, n in zip(x.stride(), x.shape))
        if ptr in seen or overlaps:
            x = x.clone()
            ptr = x.untyped_storage().data_ptr()
        seen.add(ptr)
        out[name] = x
    return out


def fold(recorded: dict[str, torch.Tensor], now: dict[str, torch.Tensor]) -> None:
    """After a step (inside the graph being recorded): the new value of every entry of `recorded` that
    the step replaced is copied into the recorded tensor. A step that drops an entry, adds one, or
    changes one's shape or dtype cannot be replayed: ConfigError, naming it."""
    for name in now.keys() - recorded.keys():
        raise ConfigError(f"config key 'cuda_graphs': the step added state '{name}' after the graph was recorded; "
                          "a replayed step keeps the same state")
    for name, old in recorded.items():
        cur = now.get(name)
        if cur is None:
            raise ConfigError(f"config key 'cuda_graphs': the step dropped '{name}'; its state cannot be replayed")
        if cur is old:
            continue
        if cur.shape != old.shape or cur.dtype != old.dtype:
            raise ConfigError(f"config key 'cuda_graphs': the step turned '{name}' from {old.dtype} {list(old.shape)} "
                              f"into {cur.dtype} {list(cur.shape)}; a replayed step keeps its state's shapes")
        old.copy_(cur)


def check_graphs(device: torch.device) -> None:
    if device.type != "cuda":
        raise ConfigError(f"config key 'cuda_graphs' needs a CUDA device; this run is on {device} (use --device cuda)")


def warm_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream that waits for the current one: warm-up calls before a capture run there (as
    torch.cuda.graphs asks), so lazily created handles and autograd's streams exist before recording."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


class GraphedStep:
    """A minibatch update step (`algo.minibatch_step`) replayed as CUDA graphs, one per minibatch size.

    The rollout's batch is copied into static buffers once per update (the step is first called with
    each new batch), the minibatch's rows into a static index before each replay. The first `warmup`
    calls of each size run eagerly on a side stream; the next one records the graph and replays it.
    Everything the step changes is in place already: parameters, Adam's moments and step counts (device
    tensors, `capturable`), the learning rate (a device tensor filled in place), gradients (`.grad`,
    allocated from the graph's memory when recorded and rewritten by each replay)."""

    def __init__(self, step: Callable[[PPOBatch, torch.Tensor], dict[str, torch.Tensor]], device: torch.device, warmup: int = 2):
        self.step, self.device, self.warmup = step, device, warmup
        self._batch: Any = None
        self._source: Any = None
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._calls: dict[int, int] = {}

    def _take(self, batch: PPOBatch) -> None:
        tensors = batch.tensors()
        if self._batch is None:
            static: dict[int, torch.Tensor] = {}
            fields = {}
            for name, x in tensors.items():
                if id(x) not in static:  # fields that share a tensor (critic_obs is obs) share its copy
                    static[id(x)] = torch.empty_like(x)
                    self._copies.append((name, static[id(x)]))
                fields[name] = static[id(x)]
            self._batch = dataclasses.replace(batch, **fields)
        for name, buf in self._copies:
            src = tensors[name]
            if src.shape != buf.shape or src.dtype != buf.dtype:
                raise ConfigError(f"config key 'cuda_graphs': the update's batch field '{name}' changed shape "
                                  f"from {list(buf.shape)} to {list(src.shape)}")
            buf.copy_(src)
        self._source = batch

    def __call__(self, batch: PPOBatch, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        if batch is not self._source:
            self._take(batch)
        n = rows.numel()
        if n not in self._rows:
            self._rows[n] = torch.empty_like(rows)
        self._rows[n].copy_(rows)
        graph = self._graphs.get(n)
        if graph is not None:
            graph[0].replay()
            return graph[1]
        calls = self._calls.get(n, 0)
        self._calls[n] = calls + 1
        if calls < self.warmup:
            side = warm_stream(self.device)
            with torch.cuda.stream(side):
                out = self.step(self._batch, self._rows[n])
            torch.cuda.current_stream(self.device).wait_stream(side)
            return out
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = self.step(self._batch, self._rows[n])
        self._graphs[n] = (g, out)
        g.replay()
        return out


# -- the rollout step, captured -------------------------------------------------------------------
def step_mode(compile: bool, cuda_graphs: bool, env: VecEnv, device: torch.device, backend: str = "inductor") -> StepMode:
    """The rollout's step mode for --compile and --cuda-graphs on `env` (refused in one line where the device or the
    env cannot have it): `compile` captures the whole step where the env declares itself capturable (else build.py
    compiles the policy's act_value alone); `cuda_graphs` records a step as a CUDA graph and replays it."""
    if cuda_graphs:
        check_graphs(device)
        if not env.capturable:
            raise ConfigError("config key 'cuda_graphs' needs an env that declares capturable = True")
        try:
            env.step_state()
        except NotImplementedError:
            raise ConfigError(f"config key 'cuda_graphs' needs an env that names its step state (step_state and "
                              f"load_step_state, docs/ENVIRONMENTS.md); env '{env.name}' does not") from None
    return StepMode(compiled=compile and env.capturable, graphed=cuda_graphs, backend=backend)


class CapturedSteps(Steps):
    """How `Rollout.collect` runs its steps under --compile (`captured`: the step compiled whole, replaying the
    noted plan of draws) and --cuda-graphs (`graphed`: eager, or compiled, until a step is recorded as a CUDA
    graph, then its replays)."""

    def __init__(self, rollout: Rollout):
        super().__init__(rollout)
        mode = rollout.mode
        if not rollout.env.capturable:
            raise ValueError("this rollout step cannot be captured whole (its env does not declare capturable = True)")
        # --compile: the whole step (torch.compile fullgraph: a graph break raises), every model, teammates and league
        # opponents included: they draw through `draws`, write memory in place, and a captured league runs every player
        # of its fixed layout. Its first call runs eagerly and notes the random draws a step makes; later calls
        # replay them in the graph.
        self.captured: Callable | None = (torch.compile(rollout.step, fullgraph=True, dynamic=False, backend=mode.backend)
                                          if mode.compiled else None)
        # A [1] index per row: one graph serves every row of the buffer.
        self.t_index: list[torch.Tensor] = [torch.tensor([t], device=rollout.device) for t in range(rollout.params.num_steps)]
        self.planned = False  # the plan of draws a step makes is noted (`note_draws`)
        self.graphed = mode.graphed  # --cuda-graphs: after one eager step that notes the draws and two warm-up steps
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm_steps = 0
        self.stats: dict[str, torch.Tensor] | None = None  # what a recorded graph adds into
        self.layout = 0  # the league's layout the graph was recorded with

    def start(self) -> dict[str, torch.Tensor]:
        r = self.rollout
        if r.league is not None and self.graph is not None and self.layout != r.league.layout:
            self.forget()  # the league's bank grew: record the step again
        if self.graphed and self.stats is not None:  # a CUDA graph adds into the tensors it was recorded with
            for k, v in self.stats.items():
                v.fill_(-1.0 if k in UNSET_STATS else 0.0)
            return self.stats
        stats = r.new_stats()
        if self.graphed:
            self.stats = stats
        return stats

    def forget(self) -> None:
        self.graph, self.warm_steps = None, 0

    def __call__(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._graph_step(t, obs_n, stats) if self.graphed else self._compiled_step(t, obs_n, stats)

    def draw_contexts(self, mode: str, queues: list[list[torch.Tensor]] | None = None) -> contextlib.ExitStack:
        """The policy's and the env's draws in one mode: 'recording', 'ahead' or 'replaying' (from `queues`)."""
        stack = contextlib.ExitStack()
        for i, d in enumerate(self.rollout.all_draws):
            stack.enter_context(d.recording() if mode == "recording" else d.ahead() if mode == "ahead" else d.replaying(queues[i]))
        return stack

    def note_draws(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        """The plan of draws a step makes (phalanx.draws), noted by one eager step whose every effect is then
        undone: the step state, normalisers, the league's game counts and the generators are put back as they
        were (the buffer's row `t` is written again by the step that follows). So every step after a start or a
        resume runs captured, and a resumed --compile run follows the uninterrupted one bit for bit."""
        r = self.rollout
        record, state = r.record, {k: v.clone() for k, v in step_state(r, stats).items()}
        norms = {k: v.clone() for k, v in r.norms.state_dict().items()}
        counts = r.league.counts.clone() if r.league is not None else None
        generators = [d.generator.get_state() for d in r.all_draws]
        with self.draw_contexts("recording"):
            r.step(t, obs_n, stats)
        for key in stats.keys() - section(state, "stats").keys():
            stats[key].zero_()  # an info key first seen in the noted step: counted from the step that follows
        r.record = record
        load_step_state(r, state, stats)
        r.norms.load_state_dict(norms)
        if counts is not None:
            r.league.counts.copy_(counts)
        for d, g in zip(r.all_draws, generators):
            d.generator.set_state(g)
        self.planned = True

    def _compiled_step(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step under --compile: the captured step, replaying the noted plan of draws."""
        r = self.rollout
        if not self.planned:
            self.note_draws(t, obs_n, stats)
        with self.draw_contexts("ahead"):
            obs_n = self.captured(self.t_index[t], obs_n, stats)
        r.bootstrap_after(t)
        return obs_n

    def _graph_step(self, t: int, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step under --cuda-graphs: eager (or compiled) until the graph is recorded, then a replay."""
        r = self.rollout
        step = self.captured or r.step
        if self.graph is None:
            if not self.planned:
                self.note_draws(t, obs_n, stats)
            if self.warm_steps < 2:
                self.warm_steps += 1
                side = warm_stream(r.device)
                with torch.cuda.stream(side), self.draw_contexts("ahead"):
                    out = step(self.t_index[t] if self.captured else t, obs_n, stats)
                torch.cuda.current_stream(r.device).wait_stream(side)
                return out
            self._record_graph(step, obs_n, stats)
        if obs_n is not self._graph_obs:
            self._graph_obs.copy_(obs_n)
        self._graph_t.fill_(t)
        for d, queue in zip(r.all_draws, self._graph_queues):
            d.refill(queue)
        self.graph.replay()
        return self._graph_obs

    def _record_graph(self, step: Callable, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        r = self.rollout
        self._graph_t = torch.zeros(1, dtype=torch.long, device=r.device)
        self._graph_queues = [d.buffers() for d in r.all_draws]
        self.layout = r.league.layout if r.league is not None else 0
        recorded = own_step_state(r, obs_n.clone(), stats)
        graph = torch.cuda.CUDAGraph()
        with self.draw_contexts("replaying", self._graph_queues), torch.cuda.graph(graph):
            self._graph_obs = folded_step(r, step, self._graph_t, recorded, stats)
        self.graph = graph


def own_step_state(rollout: Rollout, obs_n: torch.Tensor, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rollout's step state (run_state.step_state, and the step's input observation as 'obs_n'), each tensor
    in memory of its own (`own_memory`), handed back to its holders: what a recorded step reads and writes."""
    recorded = own_memory({**step_state(rollout, stats), "obs_n": obs_n})
    load_step_state(rollout, recorded, stats)
    return recorded


def folded_step(rollout: Rollout, step: Callable, t: int | torch.Tensor, recorded: dict[str, torch.Tensor],
                stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """One step from `recorded` (`own_step_state`) that leaves its new state in those same tensors (`fold`) and
    hands them back: the body of a recorded CUDA graph. -> the next observation."""
    obs_n = step(t, recorded["obs_n"], stats)
    fold(recorded, {**step_state(rollout, stats), "obs_n": obs_n})
    load_step_state(rollout, recorded, stats)
    return recorded["obs_n"]
