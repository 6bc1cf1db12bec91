"""Atomic checkpoints: tensors in safetensors, everything else in JSON; nothing is unpickled.

A checkpoint is a directory `checkpoints/step_<N>/` holding `model.safetensors` (the policy's
weights), `state.safetensors` (optimizer moments, normalisers, env and RNG states) and
`meta.json` (counters, config, file digests). It is written under a temporary name and renamed,
so a reader never sees a half-written one; the digests catch truncation and bit flips.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from phalanx import runs
from phalanx.errors import CheckpointError, StorageError, storage_reason

FORMAT_VERSION = 1
CKPT_DIR = "checkpoints"
_PREFIX = "step_"
WEIGHTS_FILE = "model.safetensors"  # a checkpoint's weights, and a package's
STATE_FILE = "state.safetensors"
# A package's observation statistics (`norm_obs`): what the graph has folded in, for a policy loaded back in torch.
OBS_STATS_FILE = "obs_stats.safetensors"


def is_package(path: Path) -> bool:
    """A folder `phalanx export --package` wrote (weights beside a config, no checkpoints): a policy to play, without
    the optimiser state and counters that resuming training takes."""
    path = Path(path)
    return (path / WEIGHTS_FILE).is_file() and (path / "config.json").is_file() and not (path / CKPT_DIR).exists()


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as JSON in `path`, whole or not at all (`runs.write_atomic`)."""
    runs.write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(_contiguous(tensors), str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor], what: str) -> None:
    """One safetensors file (`what`, e.g. a league snapshot), whole or not at all (`runs.write_atomic`)."""
    runs.write_atomic(path, lambda tmp: save_file(_contiguous(tensors), str(tmp)), what)


def read_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `path`; a missing or damaged one is refused in one line naming `what`."""
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{what} '{path}' is missing") from None
    except Exception as e:  # safetensors raises several types for damaged files
        raise CheckpointError(f"{what} '{path}' is unreadable: {e}") from None


def save_checkpoint(
    run_dir: Path, step: int, model: dict[str, torch.Tensor], state: dict[str, torch.Tensor], meta: dict[str, Any], keep: int
) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep`. Returns its path."""
    root = Path(run_dir) / CKPT_DIR
    final = root / f"{_PREFIX}{step:012d}"
    tmp = root / f".tmp-{_PREFIX}{step:012d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        files = {WEIGHTS_FILE: model, STATE_FILE: state}
        digests = {}
        for name, tensors in files.items():
            _write_tensors(tmp / name, tensors)
            digests[name] = _digest(tmp / name)
        # Inside the temporary directory, which is renamed whole: no file of its own needs to be atomic.
        with open(tmp / "meta.json", "w") as f:
            json.dump({**meta, "format_version": FORMAT_VERSION, "step": step, "digests": digests}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except (OSError, SafetensorError) as e:  # a full disk: safetensors wraps the OSError
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "; previous checkpoints are intact" if list_checkpoints(run_dir) else ""
        raise StorageError(f"could not write checkpoint '{final}': {storage_reason(e)}{kept}") from None
    prune(root, keep)
    return final


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"{_PREFIX}{step:012d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    # A symlinked entry could point anywhere: it is neither loaded nor pruned.
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name.startswith(_PREFIX))


def prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name.startswith(_PREFIX))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        # A temp dir from a killed writer is never loaded; remove it unless a live writer owns it.
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def latest_checkpoint(run_dir: Path) -> Path:
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"no checkpoint in '{Path(run_dir) / CKPT_DIR}'")
    return found[-1]


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify a checkpoint directory: (model tensors, state tensors, meta)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist" if not path.exists() else
                              f"checkpoint '{path}' is a file; a checkpoint is a directory (RUN/checkpoints/step_...)")
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' has no meta.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file '{meta_path}' is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        found = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"checkpoint '{path}' has format version {found!r}; this Phalanx reads {FORMAT_VERSION}")
    out = []
    for name in (WEIGHTS_FILE, STATE_FILE):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file '{f}' is missing")
        want = meta.get("digests", {}).get(name)
        if want is not None and _digest(f) != want:
            raise CheckpointError(f"checkpoint file '{f}' is corrupt or truncated (checksum mismatch)")
        try:
            out.append(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint file '{f}' is not a valid safetensors file: {e}") from None
    return out[0], out[1], meta


def section(tensors: dict[str, torch.Tensor], prefix: str, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The entries saved under `prefix.` (e.g. "norms", "optim.3", "model"), keyed without it."""
    head = prefix + "."
    return {k[len(head):]: (v if device is None else v.to(device)) for k, v in tensors.items() if k.startswith(head)}


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str | Path) -> None:
    """Load a state dict into `model`, or one line naming `source` and the first mismatch."""
    dev = next(model.parameters()).device
    try:
        model.load_state_dict({k: v.to(dev) for k, v in tensors.items()})
    except RuntimeError as e:
        raise CheckpointError(f"{source} does not fit this model: {str(e).splitlines()[0]}") from None


def check_compatible(path: Path, meta: dict[str, Any], env: str, model: nn.Module) -> None:
    """A checkpoint from an env other than `env` or of another model shape is refused, naming the mismatch."""
    saved = meta.get("config", {})
    if meta.get("env") != env:
        raise CheckpointError(f"checkpoint '{path}' is for env '{meta.get('env')}', not '{env}'")
    shapes = meta.get("model_shapes", {})
    for k, v in model.state_dict().items():
        if k not in shapes:
            raise CheckpointError(f"checkpoint '{path}' lacks parameter '{k}' (model '{saved.get('model')}' {saved.get('hidden_sizes')})")
        if list(v.shape) != shapes[k]:
            raise CheckpointError(f"checkpoint '{path}' parameter '{k}' has shape {shapes[k]}, the model expects {list(v.shape)}")
