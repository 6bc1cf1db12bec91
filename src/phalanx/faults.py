"""What a run that ends on a fault leaves behind and says: the env's traceback, the non-finite batch, where to
resume from. Each fault ends in one line (errors.py) that names what was kept."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from phalanx import checkpoint as ckpt
from phalanx import runs
from phalanx.algo import PPOBatch
from phalanx.config import Config
from phalanx.envs.base import VecEnv
from phalanx.errors import EnvCrashError, OutsidePlayerError, one_line, storage_reason


def kept(run_dir: Path) -> str:
    """What a run that ends on a fault leaves to resume from, as the end of its one line."""
    last = ckpt.list_checkpoints(run_dir)
    if not last:
        return (f"no checkpoint was written yet, so there is nothing to resume; start again with --run-dir {run_dir} "
                f"--overwrite, or another --run-dir")
    return (f"last checkpoint: step {int(last[-1].name.removeprefix('step_')):,}; resume with "
            f"`phalanx train --resume {run_dir}`")


def env_crash(e: Exception, env: VecEnv, rollout: object, env_name: str, num_envs: int, run_dir: Path,
              global_step: int, update_idx: int, world: int) -> EnvCrashError | None:
    """An exception raised inside the env's own code during `rollout`'s collection (of `num_envs` envs of `env_name`
    on each of `world` ranks), as one line naming the env, the step and the exception, with the traceback written to
    the run directory; None where the env's step is not on the traceback (a fault of Phalanx itself keeps its
    traceback)."""
    frames = [f for f, _ in traceback.walk_tb(e.__traceback__)]
    if not any(f.f_locals.get("self") is env for f in frames):
        return None
    at = next((f.f_locals["t"] for f in reversed(frames)
               if f.f_locals.get("self") is rollout and isinstance(f.f_locals.get("t"), int)), None)
    step = global_step + (0 if at is None else at * num_envs * world)
    where = f"at step {step:,}" + ("" if at is None else f" (rollout step {at} of update {update_idx + 1})")
    written = _write_traceback(e, run_dir / "env_crash.txt")
    return EnvCrashError(f"env '{env_name}' raised {where}: {one_line(e)}; {written}; {kept(run_dir)}")


def _write_traceback(e: BaseException, path: Path) -> str:
    """`e`'s traceback into `path`; -> what the one line says of it (where it is, or why it could not be written)."""
    try:
        path.write_text("".join(traceback.format_exception(e)).rstrip("\n") + "\n")
        return f"traceback in '{path}'"
    except OSError as fault:
        return f"its traceback could not be written to '{path}': {storage_reason(fault)}"


def player_crash(e: Exception, run_dir: Path) -> OutsidePlayerError | None:
    """An opponent written outside Phalanx that raised (or returned no action) during a run's collection: its line,
    the traceback of its own code written to the run directory (as an env crash's), and what there is to resume;
    None for any other exception."""
    if not isinstance(e, OutsidePlayerError):
        return None
    written = _write_traceback(e.__cause__ or e, run_dir / "opponent_crash.txt")
    return OutsidePlayerError(f"{e}; {written}; {kept(run_dir)}")


def save_nonfinite(run_dir: Path, update_idx: int, batch: PPOBatch, cfg: Config, metrics: dict[str, Any]) -> Path:
    """The batch, config and metrics of the update that went non-finite, for a post-mortem; -> their directory."""
    out = run_dir / f"nonfinite_update_{update_idx:06d}"
    with runs.writing("the non-finite batch", out):
        out.mkdir(exist_ok=True)
        save_file({k: v.detach().cpu().clone() for k, v in batch.tensors().items()}, str(out / "batch.safetensors"))
    ckpt.write_json_atomic(out / "config.json", cfg.to_dict())
    ckpt.write_json_atomic(out / "metrics.json", metrics)
    return out
