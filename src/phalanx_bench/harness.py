"""The measuring harness of `phalanx bench`: timed windows of a step (`measure`), contestants timed in turn
(`measure_alternating`), how busy other processes kept the CPUs, waiting for quiet, the peak memory of a block,
and the machine's description."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class CpuMonitor:
    """How busy the machine was with *other* processes between start() and stop() (Linux /proc only).

    Returns the share of all cores used by others (0..1), or None where /proc/stat is missing.
    Benchmarks on a shared machine are meaningless above a few percent: torch's OpenMP threads
    wait for each other at every op, so one descheduled thread stalls the whole process.
    """

    def __init__(self) -> None:
        self._start: tuple[float, float, float] | None = None

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [float(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)) / hz  # minus idle, iowait
        t = os.times()
        return busy, t.user + t.system, time.perf_counter()

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> float | None:
        end = self._read()
        if self._start is None or end is None:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self._start))
        if wall <= 0:
            return None
        return max(0.0, min(1.0, (busy - own) / (wall * (os.cpu_count() or 1))))


_wait_idle = 0.0  # seconds; set by --wait-idle


def set_wait_idle(seconds: float) -> None:
    """Before each measurement, wait up to `seconds` for other processes to go quiet (0: never wait)."""
    global _wait_idle
    _wait_idle = seconds


def settle() -> None:
    """Wait for other processes to go quiet, up to the --wait-idle seconds."""
    if _wait_idle > 0:
        wait_for_idle(_wait_idle)


def wait_for_idle(limit: float, quiet: float = 0.05, probe: float = 0.5) -> None:
    """Wait up to `limit` seconds until other processes use less than `quiet` of the CPUs."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        mon = CpuMonitor()
        mon.start()
        time.sleep(probe)
        busy = mon.stop()
        if busy is None or busy < quiet:
            return


def measure(
    step: Callable[[], Any], steps_per_call: int, seconds: float, device: torch.device, warmup: int = 1
) -> dict[str, float]:
    """Calls `step` `warmup` times untimed, then in timed windows of ~0.25 s (at least one call each)
    until `seconds` have passed. `sps` is the fastest window (the least disturbed one), `mean_sps` the
    average over all windows, `others_busy` the share of the machine other processes used meanwhile."""
    w0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    warmup_seconds = time.perf_counter() - w0
    settle()
    window = min(0.25, seconds)
    rates: list[float] = []
    calls = 0
    mon = CpuMonitor()
    mon.start()
    t0 = time.perf_counter()
    while True:
        w0 = time.perf_counter()
        n = 0
        while True:
            step()
            n += 1
            if n % 4 == 0 or steps_per_call >= 4096:
                sync(device)
                if time.perf_counter() - w0 >= window:
                    break
        sync(device)
        now = time.perf_counter()
        rates.append(n * steps_per_call / (now - w0))
        calls += n
        if now - t0 >= seconds:
            break
    dt = time.perf_counter() - t0
    return {"sps": max(rates), "mean_sps": calls * steps_per_call / dt, "seconds": dt, "iterations": calls,
            "windows": len(rates), "others_busy": mon.stop(), "warmup_seconds": warmup_seconds}


def measure_alternating(
    steps: dict[str, tuple[Callable[[], Any], int]], seconds: float, device: torch.device, warmup: int = 1
) -> dict[str, dict[str, Any]]:
    """Measures several contestants (name -> (step, steps per call)) turn by turn: each round times one
    window (~0.25 s, at least one call) of each, until every one has run `seconds`. A drift of the
    machine's speed then hits all alike, so the ratio of two contestants is the median over rounds of
    their rates' ratio (`ratios`), not a quotient of runs taken minutes apart. `sps` is each one's
    fastest window, as `measure` reports it."""
    warm: dict[str, float] = {}
    for name, (step, _) in steps.items():
        w0 = time.perf_counter()
        for _ in range(warmup):
            step()
        sync(device)
        warm[name] = time.perf_counter() - w0
    settle()
    rates: dict[str, list[float]] = {name: [] for name in steps}
    spent = dict.fromkeys(steps, 0.0)
    calls = dict.fromkeys(steps, 0)
    mon = CpuMonitor()
    mon.start()
    while min(spent.values()) < seconds:
        for name, (step, per_call) in steps.items():
            w0 = time.perf_counter()
            n = 0
            while True:
                step()
                n += 1
                sync(device)
                if time.perf_counter() - w0 >= 0.25:
                    break
            dt = time.perf_counter() - w0
            rates[name].append(n * per_call / dt)
            spent[name] += dt
            calls[name] += n
    busy = mon.stop()
    return {name: {"sps": max(r), "mean_sps": calls[name] * steps[name][1] / spent[name], "seconds": spent[name],
                   "iterations": calls[name], "windows": len(r), "rates": r, "others_busy": busy,
                   "warmup_seconds": warm[name]} for name, r in rates.items()}


def median_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The median over rounds of a's rate / b's rate (both from one `measure_alternating`)."""
    return statistics.median(x / y for x, y in zip(a["rates"], b["rates"]))


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(), "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "device": str(device), "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def worst_others(*ms: dict | None) -> float | None:
    """The worst `others_busy` of a row's measurements (None where /proc/stat is missing)."""
    busy = [m["others_busy"] for m in ms if m and m["others_busy"] is not None]
    return max(busy) if busy else None


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set to its current one (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") is not None


def _maxrss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def _trim_heap() -> None:
    """Free what can be freed and hand glibc's free heap back to the OS, so the next baseline is the live set."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of the block in `with PeakMemory(device) as mem:`; afterwards `mem.result` = {"bytes", "method"}.

    * "cuda_max_memory_allocated": `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, the most
      bytes held by tensors at once (not the caching allocator's reserve, not the CUDA context).
    * "rss_peak_growth" (CPU, Linux): the process's peak resident set during the block (VmHWM, the figure
      `ru_maxrss` reports) minus its resident set at the start; the peak is reset through
      /proc/self/clear_refs and glibc's free heap trimmed first, so an earlier, larger measurement does not
      hide this one. It counts everything the block touched: env, model, optimizer, rollout buffer, temporaries.
    * "ru_maxrss_growth" (CPU where the peak cannot be reset): how far the block raised `ru_maxrss`; 0 when it
      stayed below an earlier peak, so only the largest measurement so far is exact.
    * "unavailable" (other devices): bytes None.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.result: dict[str, Any] = {"bytes": None, "method": "unavailable"}
        self._base = 0
        self._method = "unavailable"

    def __enter__(self) -> PeakMemory:
        _trim_heap()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._method = "cuda_max_memory_allocated"
        elif self.device.type == "cpu" and _reset_peak_rss():
            self._method, self._base = "rss_peak_growth", (_proc_status_kib("VmRSS") or 0) * 1024
        elif self.device.type == "cpu":
            self._method, self._base = "ru_maxrss_growth", _maxrss_bytes()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._method == "cuda_max_memory_allocated":
            sync(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self._method == "rss_peak_growth":
            peak = max(0, (_proc_status_kib("VmHWM") or 0) * 1024 - self._base)
        elif self._method == "ru_maxrss_growth":
            peak = max(0, _maxrss_bytes() - self._base)
        else:
            peak = None
        self.result = {"bytes": peak, "method": self._method}
        return False
