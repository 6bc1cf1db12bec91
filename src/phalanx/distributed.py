"""Data-parallel training across processes started by torchrun (one process per device).

Each rank steps its own environments with its own seed stream; gradients are averaged across
ranks before every optimizer step, normaliser statistics are pooled after every rollout and update,
so the ranks keep identical parameters and statistics. Only rank 0 logs and writes checkpoints;
each rank's own dynamic state (envs, generators, episode counters) travels into the checkpoint
as `rank<r>.<key>` tensors. Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import ConfigError


class Dist:
    """The process group of a run; a single process is rank 0 of 1 and every method is a no-op."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on this node: they share its CPUs

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def init(self, device: torch.device) -> torch.device:
        """Join the process group; returns this rank's device (cuda:LOCAL_RANK on CUDA)."""
        if not self.enabled:
            return device
        if device.type == "cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise ConfigError(f"torchrun started local rank {self.local_rank} but this node has {torch.cuda.device_count()} "
                                  f"CUDA devices; use --nproc-per-node {torch.cuda.device_count()} or --device cpu")
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        self.device = device
        return device

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value on every rank (e.g. a timestamp that names the run directory)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.broadcast(t, 0)
        return int(t.item())

    @torch.no_grad()
    def broadcast_module(self, module: nn.Module) -> None:
        """Rank 0's parameters and buffers, in place on every rank."""
        if self.enabled:
            for t in module.state_dict().values():
                dist.broadcast(t, 0)

    @torch.no_grad()
    def average_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Mean gradients over ranks, with one flat all-reduce."""
        if not self.enabled:
            return grads
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        return [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)]

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return t
        t = t.clone()
        dist.all_reduce(t)
        return t / self.world

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return t
        t = t.clone()
        dist.all_reduce(t)
        return t

    @torch.no_grad()
    def pool_stats(self, rms: nn.Module | None) -> None:
        """Pool a RunningMeanStd across ranks: the mixture of the ranks' distributions (each rank
        saw as many samples, so the count stays and the moments average)."""
        if not self.enabled or rms is None:
            return
        mean = self.mean(rms.mean)
        second = self.mean(rms.var + rms.mean**2)
        rms.mean.copy_(mean)
        rms.var.copy_((second - mean**2).clamp_min(0.0))

    def gather_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's dynamic state, keyed `rank<r>.<key>` (complete on rank 0, whose result is saved)."""
        if not self.enabled:
            return tensors
        out: dict[str, torch.Tensor] = {}
        for key in sorted(tensors):
            t = tensors[key]
            moved = t.to(self.device)
            if moved.dtype == torch.bool:  # not every backend reduces bools
                moved = moved.to(torch.uint8)
            parts = [torch.empty_like(moved) for _ in range(self.world)]
            dist.all_gather(parts, moved.contiguous())
            for r, p in enumerate(parts):
                out[f"rank{r}.{key}"] = p.to(device=t.device, dtype=t.dtype)
        return out

    def local_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a saved state (a run saved by one process has no rank prefixes)."""
        prefix = f"rank{self.rank}."
        mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        return mine if mine else tensors
