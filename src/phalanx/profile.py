"""A per-phase clock built into the trainer (as PufferLib's profile): off by default, where a phase
costs one attribute read; `phalanx bench profile` switches it on."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

PHASES = ("env_step", "policy_forward", "opponents", "gae", "collect", "update")


class PhaseTimer:
    """Seconds spent per phase; nested phases count once each (a phase inside another of the same name
    is not double counted). On an accelerator every edge synchronises, so switch it on only to profile."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = False):
        self.device = torch.device(device)
        self.enabled = enabled
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._open: set[str] = set()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if name in self._open:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        self._open.add(name)
        try:
            yield
        finally:
            self._open.discard(name)
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        # Inside a captured graph there is no clock to read: a compiled or CUDA-graph rollout step counts
        # as `collect` (and a synchronisation while a CUDA graph records is an error).
        if not self.enabled or torch.compiler.is_compiling():
            return contextlib.nullcontext()
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return contextlib.nullcontext()
        return self._timed(name)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
