"""--cuda-graphs: the rollout step and the minibatch update step recorded once as CUDA graphs and
replayed, so each costs one launch instead of hundreds of small ones.

A graph replays the kernels of one recorded call on the same memory. An eager step becomes
replayable when (1) what it reads arrives at fixed addresses: the caller copies fresh inputs (the
minibatch's rows, the rollout's batch, the random draws) into static buffers before each replay, and
(2) the state it carries to the next call comes back to those addresses. The rollout step's state is
named, by contract, as one flat dict of tensors (`Rollout.step_state`: the env's `step_state`, the
records, counters, memories and league assignments); a step may replace those tensors rather than
write them in place (`self.x = torch.where(...)`). Before recording, `own_memory` gives every entry
memory of its own; at the end of the recorded step, inside the graph, `fold` copies the new values
into the recorded tensors, and the caller puts them back (`load_step_state`). Every replay then reads
and writes the same memory, as the eager loop would. Modules' parameters and buffers are written in
place by contract (optimizer, normalisers), so they are not part of the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from phalanx.algo.ppo import PPOBatch
from phalanx.errors import ConfigError


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
