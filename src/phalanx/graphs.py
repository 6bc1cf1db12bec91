"""--cuda-graphs: the rollout step and the minibatch update step recorded once as CUDA graphs and
replayed, so each costs one launch instead of hundreds of small ones.

A graph replays the kernels of one recorded call on the same memory. An eager step becomes
replayable when (1) what it reads arrives at fixed addresses: the caller copies fresh inputs (the
minibatch's rows, the rollout's batch, the random draws) into static buffers before each replay, and
(2) the state it carries to the next call comes back to those addresses. Envs, episode counters and
normalisers keep state in tensor attributes that a step may replace (`self.x = torch.where(...)`)
rather than write in place; `Carried` notes where each such tensor lives before the recorded call
and, at its end and inside the graph, copies the new values into the old tensors and puts the old
tensors back. Every replay then reads and writes the same memory, as the eager loop would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from phalanx.draws import Draws
from phalanx.errors import ConfigError

MAX_DEPTH = 6


@dataclasses.dataclass
class _Holder:
    """An object or dict that held carried tensors when the graph was recorded, and its entries."""

    obj: Any
    entries: dict[Any, Any]  # key -> tensor or _Holder


def _entries(x: Any) -> Iterable[tuple[Any, Any]] | None:
    if isinstance(x, dict):
        return list(x.items())
    if isinstance(x, (Draws, torch.Generator, type)) or not hasattr(x, "__dict__") or callable(x) and not isinstance(x, nn.Module):
        return None
    # A module's parameters are updated in place by the optimizer, never replaced: only its buffers
    # and submodules can carry state.
    return [(k, v) for k, v in vars(x).items() if k != "_parameters"]


def _get(holder: Any, key: Any) -> Any:
    return holder[key] if isinstance(holder, dict) else getattr(holder, key)


def _set(holder: Any, key: Any, value: Any) -> None:
    if isinstance(holder, dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


class Carried:
    """The tensors on `device_type` reachable from `roots` (through attributes, dicts and modules'
    buffers; not parameters), as they are now; `fold()` brings a step's values back into them (see the
    module docstring). Objects in `skip` are not searched."""

    def __init__(self, roots: dict[str, Any], skip: Iterable[Any] = (), device_type: str = "cuda"):
        self._skip = {id(s) for s in skip}
        self.device_type = device_type
        seen: set[int] = set()
        storages: set[int] = set()
        self.root = _Holder(roots, {})
        for name, obj in roots.items():
            node = self._walk(roots, name, obj, seen, storages, 0)
            if node is not None:
                self.root.entries[name] = node

    def _walk(self, holder: Any, key: Any, x: Any, seen: set[int], storages: set[int], depth: int) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device.type != self.device_type or isinstance(x, nn.Parameter):
                return None
            base = x.untyped_storage().data_ptr()
            overlaps = any(s == 0 and n > 1 for s, n in zip(x.stride(), x.shape))
            if base in storages or overlaps:
                # Two carried names for one memory (an env returning its own buffer as `obs`, a view of
                # another state tensor): each gets its own copy, so folding one cannot overwrite the other.
                x = x.clone()
                _set(holder, key, x)
            storages.add(x.untyped_storage().data_ptr())
            return x
        if depth >= MAX_DEPTH or id(x) in seen or id(x) in self._skip:
            return None
        items = _entries(x)
        if items is None:
            return None
        seen.add(id(x))
        entries = {}
        for k, v in items:
            node = self._walk(x, k, v, seen, storages, depth + 1)
            if node is not None:
                entries[k] = node
        return _Holder(x, entries) if entries else None

    def fold(self) -> None:
        """After a step: each carried tensor that was replaced gets the new value copied in and is put back."""
        self._fold(self.root, self.root.obj, "")

    def _fold(self, node: _Holder, now: Any, path: str) -> Any:
        for key, old in node.entries.items():
            where = f"{path}.{key}" if path else str(key)
            try:
                cur = _get(now, key)
            except (KeyError, AttributeError):
                raise ConfigError(f"config key 'cuda_graphs': the step dropped '{where}'; its state cannot be replayed") from None
            if isinstance(old, _Holder):
                _set(node.obj, key, self._fold(old, cur, where))
                continue
            if cur is not old:
                if not isinstance(cur, torch.Tensor) or cur.shape != old.shape or cur.dtype != old.dtype:
                    got = f"{cur.dtype} {list(cur.shape)}" if isinstance(cur, torch.Tensor) else type(cur).__name__
                    raise ConfigError(f"config key 'cuda_graphs': the step turned '{where}' from {old.dtype} "
                                      f"{list(old.shape)} into {got}; a replayed step keeps its state's shapes")
                old.copy_(cur)
            _set(node.obj, key, old)
        return node.obj


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

    def __init__(self, step: Callable[[Any, torch.Tensor], dict[str, torch.Tensor]], device: torch.device, warmup: int = 2):
        self.step, self.device, self.warmup = step, device, warmup
        self._batch: Any = None
        self._source: Any = None
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._calls: dict[int, int] = {}

    def _take(self, batch: Any) -> None:
        if self._batch is None:
            static: dict[int, torch.Tensor] = {}
            fields = {}
            for f in dataclasses.fields(batch):
                x = getattr(batch, f.name)
                if isinstance(x, torch.Tensor):
                    if id(x) not in static:  # fields that share a tensor (critic_obs is obs) share its copy
                        static[id(x)] = torch.empty_like(x)
                        self._copies.append((f.name, static[id(x)]))
                    fields[f.name] = static[id(x)]
                else:
                    fields[f.name] = x
            self._batch = dataclasses.replace(batch, **fields)
        for name, buf in self._copies:
            src = getattr(batch, name)
            if src.shape != buf.shape or src.dtype != buf.dtype:
                raise ConfigError(f"config key 'cuda_graphs': the update's batch field '{name}' changed shape "
                                  f"from {list(buf.shape)} to {list(src.shape)}")
            buf.copy_(src)
        self._source = batch

    def __call__(self, batch: Any, rows: torch.Tensor) -> dict[str, torch.Tensor]:
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
