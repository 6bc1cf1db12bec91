"""Where a run computes: the device, torch's CPU threads per phase, free memory, the host allocator."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.errors import ConfigError

# The oldest torch each path was seen to work on (scripts/torch_floor_smoke.sh; the README's "Versions"):
# below TORCH_FLOOR the fused Adam's version bump takes one tensor, not a list; below COMPILE_FLOOR Dynamo
# cannot trace the update step's autograd calls into its graph (no `trace_autograd_ops`).
TORCH_FLOOR = (2, 5)
COMPILE_FLOOR = (2, 11)


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: the torch running), e.g. '2.13.0+cpu' -> (2, 13)."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def require_torch(what: str, floor: tuple[int, int], version: str | None = None) -> None:
    """One line where the torch running is older than `what` needs."""
    found = version or torch.__version__
    if torch_release(found) < floor:
        need = ".".join(map(str, floor))
        raise ConfigError(f"{what} needs torch >= {need}; this is torch {found} (pip install 'torch>={need}')")


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA, then MPS, then CPU; an explicit device must exist (checked before allocating)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"config key 'device' must be auto, cpu, cuda, cuda:N or mps; got {name!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("config key 'device' is 'cuda' but no CUDA device is available; use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"config key 'device' names {name} but only {torch.cuda.device_count()} CUDA devices exist")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
            raise ConfigError("config key 'device' is 'mps' but MPS is not available; use --device cpu or auto")
    elif dev.type != "cpu":
        raise ConfigError(f"config key 'device' must be auto, cpu, cuda, cuda:N or mps; got {name!r}")
    return dev


# Multiply-adds one call must reach before a second CPU thread pays: the policy's parameters times the rows
# the call sees (a rollout step's agents, a minibatch's samples). Calibrated on cartpole's MLP (9,155
# parameters), which trains as fast on one thread as on two up to 1,024 envs and 1.4x faster on two at
# 4,096: 2,048 rows of it. Counting rows alone (#27) kept VMAS navigation's 12,000-row minibatches of a
# 151,815-parameter MLP on one thread: an optimisation pass took 1.84 s instead of 1.24 s on two (#30).
THREADED_WORK = 2048 * 9155


@dataclass(frozen=True)
class Threads:
    """Torch CPU threads per phase of an update cycle, and why (printed at the start of a run)."""

    collect: int
    update: int
    why: str

    def __str__(self) -> str:
        counts = str(self.collect) if self.collect == self.update else f"{self.collect} to collect, {self.update} to update"
        return f"{counts} ({self.why})"


def choose_threads(requested: int, device: torch.device, collect_work: int, update_work: int,
                   local_ranks: int = 1) -> Threads:
    """Threads for `torch_threads` = `requested` (0: chosen per phase from its work, multiply-adds a call:
    `collect_work` for a rollout step, `update_work` for a minibatch). One thread where a call is small on
    the CPU, where a pool only adds barriers; else the CPUs this process may use, shared among the node's
    ranks. Accelerators keep torch's default (the host work is launches)."""
    if requested > 0:
        return Threads(requested, requested, "torch_threads")
    if device.type != "cpu":
        return Threads(torch.get_num_threads(), torch.get_num_threads(), f"torch's default on {device.type}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cpus // max(1, local_ranks))

    def count(work: int) -> int:
        return share if work >= THREADED_WORK else 1

    where = f"{cpus} CPUs" + (f" shared by {local_ranks} ranks" if local_ranks > 1 else "")
    return Threads(count(collect_work), count(update_work),
                   f"auto: {where}; more than one pays from {THREADED_WORK / 1e6:.1f}M multiply-adds a call: "
                   f"{collect_work / 1e6:,.1f}M a rollout step, {update_work / 1e6:,.1f}M a minibatch")


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory of a device (CUDA: the driver's figure; CPU: MemAvailable), None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def tune_host_allocator() -> bool:
    """Keep freed host memory in the process (glibc): by default glibc returns the heap's free top
    and every large block to the system at once, so each training step faulted its activations in
    again; on 2 CPU cores that system time was about a tenth of a cartpole training process
    (`phalanx train` does this at start; a Python program may call it too). Returns whether it applied."""
    name = ctypes.util.find_library("c")
    if name is None or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    # 32 MiB is the largest mmap threshold glibc accepts on 64-bit systems.
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
