"""Filesystem faults and crashing envs are input errors: one line naming the path (or env and step) and what
failed, exit status 2, no partial checkpoint or temporary file left, the last good checkpoint intact.

Real faults where the machine allows them without privileges: a file size limit (RLIMIT_FSIZE) everywhere on
Linux, and a small or read-only tmpfs in a user namespace (`unshare -rm`) where the kernel permits one."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
from phalanx import checkpoint as ckpt
from phalanx.cli import main
from phalanx.config import resolve
from phalanx.errors import StorageError
from phalanx.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(env="cartpole", num_envs=4, num_steps=16, num_minibatches=2, num_epochs=1, progress=False, tensorboard=False)
TRAIN = [sys.executable, "-m", "phalanx", "train", "--env", "cartpole", "--num-envs", "8", "--num-steps", "16",
         "--num-epochs", "1", "--progress", "false", "--tensorboard", "false", "--torch-threads", "1"]
PHALANX = [sys.executable, "-m", "phalanx"]


def _namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt || exit 1"],
                           capture_output=True)
    return probe.returncode == 0


NAMESPACES = sys.platform == "linux" and _namespaces()
needs_tmpfs = pytest.mark.skipif(not NAMESPACES, reason="no user namespaces here to mount a small tmpfs without root")


def _in_tmpfs(mount: Path, size: str, setup: str, argv: list[str], read_only: bool = False) -> subprocess.CompletedProcess:
    """`argv` run in a private mount namespace where `mount` is a fresh tmpfs of `size` (`setup`, a shell line,
    runs first, in `mount`'s parent directory; then the tmpfs becomes read-only if asked)."""
    mount.mkdir(parents=True, exist_ok=True)
    ro = f" && mount -o remount,ro {mount}" if read_only else ""
    script = f"mount -t tmpfs -o size={size} tmpfs {mount} && {setup}{ro} && exec \"$@\""
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *argv], cwd=mount.parent,
                          capture_output=True, text=True, timeout=120)


def _one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("phalanx: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def _no_leftovers(run: Path) -> None:
    assert not list(run.rglob(".tmp-*")) and not list(run.rglob("*.tmp")), sorted(run.rglob("*"))
    for path in ckpt.list_checkpoints(run):
        ckpt.load_checkpoint(path)  # every checkpoint left verifies against its digests


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


linux_only = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")


@linux_only
def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_last_one_stays(tmp_path):
    """A run resumed under a 512 KiB file size limit: its next checkpoint (a 256x256 MLP's weights are about 0.6 MB)
    cannot be written. One line; the checkpoint it resumed from intact and loadable; no temporary directory."""
    run = tmp_path / "r"
    phalanx.train(total_steps=256, checkpoint_every=256, run_dir=run, hidden_sizes=[256, 256], **SMALL)
    proc = subprocess.run(PHALANX + ["train", "--resume", str(run), "--total-steps", "512"], capture_output=True,
                          text=True, timeout=120, preexec_fn=_limit_file_size(512 << 10))
    _one_error_line(proc, f"could not write checkpoint '{run / 'checkpoints' / 'step_000000000512'}': File too large (the "
                          "file size limit); previous checkpoints are intact; last checkpoint: step 256; resume with "
                          f"`phalanx train --resume {run}`")
    _no_leftovers(run)
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_000000000256"]


@linux_only
def test_a_league_snapshot_that_cannot_be_written_is_one_line(tmp_path):
    """A self-play run under a 64 KiB file size limit: its first league snapshot (a 256x256 MLP's weights, about
    0.6 MB) cannot be written. It ended in a SafetensorError traceback with exit status 1."""
    run = tmp_path / "r"
    proc = subprocess.run(TRAIN[:5] + ["duel", *TRAIN[6:], "--run-dir", str(run), "--total-steps", "1024",
                                       "--hidden-sizes", "256,256"],
                          capture_output=True, text=True, timeout=120, preexec_fn=_limit_file_size(64 << 10))
    _one_error_line(proc, f"could not write league snapshot '{run / 'league' / 'snapshots'}/snapshot_",
                    ".safetensors': File too large (the file size limit)")
    _no_leftovers(run)
    assert not list((run / "league" / "snapshots").iterdir())


@linux_only
def test_a_log_that_cannot_grow_mid_run_is_one_line_and_the_checkpoints_stay(tmp_path):
    """metrics.jsonl grows a row per update until it meets a 48 KiB file size limit."""
    run = tmp_path / "r"
    proc = subprocess.run(TRAIN + ["--run-dir", str(run), "--total-steps", str(128 * 4000), "--checkpoint-every", "1280",
                                   "--keep-checkpoints", "2", "--hidden-sizes", "16"],
                          capture_output=True, text=True, timeout=120, preexec_fn=_limit_file_size(48 << 10))
    line = _one_error_line(proc, f"could not write metrics '{run / 'metrics.jsonl'}': File too large (the file size limit)")
    _no_leftovers(run)
    kept = ckpt.list_checkpoints(run)
    assert len(kept) == 2 and line.endswith(f"; last checkpoint: step {int(kept[-1].name.removeprefix('step_')):,}; "
                                            f"resume with `phalanx train --resume {run}`")


@needs_tmpfs
def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    """A 3 MB tmpfs (the issue's reproduction): once full, `phalanx train` said
    `SafetensorError: No space left on device` in a traceback and left a `.tmp-step_*` directory per try."""
    disk = tmp_path / "disk"
    proc = _in_tmpfs(disk, "3m", "true", TRAIN + ["--run-dir", "disk/r", "--total-steps", str(128 * 4000),
                                                  "--checkpoint-every", "512", "--hidden-sizes", "512,512"])
    _one_error_line(proc, "No space left on device (disk full)", "disk/r")
    # The tmpfs went with its namespace: what is left to see is the message, asserted above.


@needs_tmpfs
@pytest.mark.parametrize("command", ["resume", "plot"])
def test_a_read_only_run_directory_is_one_line(tmp_path, command):
    base = tmp_path / "base"
    phalanx.train(total_steps=128, run_dir=base, **SMALL)
    disk = tmp_path / "disk"
    argv = (PHALANX + ["train", "--resume", "disk/r", "--total-steps", "256"] if command == "resume"
            else PHALANX + ["plot", "disk/r"])
    proc = _in_tmpfs(disk, "20m", f"cp -r {base} disk/r", argv, read_only=True)
    _one_error_line(proc, "disk/r", "Read-only file system")


@needs_tmpfs
def test_a_read_only_parent_is_refused_before_anything_is_built(tmp_path):
    disk = tmp_path / "disk"
    proc = _in_tmpfs(disk, "1m", "mkdir disk/p", TRAIN + ["--run-dir", "disk/p/new", "--total-steps", "128"], read_only=True)
    _one_error_line(proc, "run directory 'disk/p/new' is not writable (in 'disk/p'): Read-only file system")


def test_a_run_dir_that_is_a_file_and_one_under_a_file_are_refused(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["train", "--run-dir", str(afile), "--total-steps", "2048", "--progress", "false"]) == 2
    assert capsys.readouterr().err.strip() == f"phalanx: error: run directory '{afile}' is a file, not a directory"
    assert main(["train", "--run-dir", str(afile / "sub"), "--total-steps", "2048", "--progress", "false"]) == 2
    assert capsys.readouterr().err.strip() == (f"phalanx: error: run directory '{afile / 'sub'}' cannot be made: '{afile}' "
                                              "is a file, not a directory")
    assert afile.read_text() == "x"


def test_a_plot_format_matplotlib_cannot_write_is_refused(tmp_path, capsys):
    run = tmp_path / "r"
    phalanx.train(total_steps=64, run_dir=run, **SMALL)
    assert main(["plot", str(run), "--out", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"phalanx: error: plot file '{tmp_path / 'x.txt'}' has format 'txt'; the formats are ")
    assert "png" in err and "\n" not in err
    assert not list(tmp_path.glob("*x.txt*"))


def test_a_config_file_of_binary_bytes_is_refused(tmp_path, capsys):
    cfg = tmp_path / "bin.yaml"
    cfg.write_bytes(b"lr: \xff\xfe\x00\x01\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip() == f"phalanx: error: config file '{cfg}' is not UTF-8 text (byte 0xff at offset 4)"


def test_an_env_that_raises_mid_run_ends_in_one_line_with_its_traceback_kept(tmp_path, capsys, monkeypatch):
    """The env's own step raises at its 500th call: one line names the env, the step and the exception's first line;
    exit 2; the checkpoints written before stay; the whole traceback is in the run directory."""
    monkeypatch.syspath_prepend(str(REPO))
    run = tmp_path / "r"
    status = main(["train", "--env", "tests.contract_envs:raises_mid_run", "--num-envs", "8", "--num-steps", "16",
                   "--num-epochs", "1", "--total-steps", "20000", "--checkpoint-every", "1024", "--run-dir", str(run),
                   "--progress", "false", "--tensorboard", "false"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err, err
    kept = ckpt.list_checkpoints(run)
    assert [int(p.name.removeprefix("step_")) for p in kept] == [1024, 2048, 3072]
    assert err == (f"phalanx: error: env 'tests.contract_envs:raises_mid_run' raised at step 3,984 (rollout step 2 of "
                   f"update 32): ValueError: cell index 500 out of range; traceback in '{run / 'env_crash.txt'}'; "
                   f"last checkpoint: step 3,072; resume with `phalanx train --resume {run}`")
    trace = (run / "env_crash.txt").read_text()
    assert trace.startswith("Traceback") and "contract_envs.py" in trace and "second line of the message" in trace
    _no_leftovers(run)


def test_a_fault_of_phalanx_itself_keeps_its_traceback(tmp_path, monkeypatch):
    """Only the env's own exceptions become the one-line env crash: a bug in the rollout is not blamed on the env."""
    trainer = Trainer(resolve(dict(SMALL, run_dir=str(tmp_path / "r"))))
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the rollout")

        monkeypatch.setattr(trainer.run.rollout, "step", broken)
        with pytest.raises(RuntimeError, match="a bug in the rollout"):
            trainer.train(max_updates=1)
        assert not (tmp_path / "r" / "env_crash.txt").exists()
    finally:
        trainer.close()


def test_a_json_file_that_cannot_be_written_is_a_storage_error_and_the_old_one_stays(tmp_path, monkeypatch):
    path = tmp_path / "league.json"
    ckpt.write_json_atomic(path, {"a": 1})

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # where a full disk often shows: the data would not reach it
    with pytest.raises(StorageError, match=f"could not write file '{path}': No space left on device "
                                                          r"\(disk full\)$"):
        ckpt.write_json_atomic(path, {"a": 2})
    assert path.read_text() == '{\n  "a": 1\n}' and sorted(p.name for p in tmp_path.iterdir()) == ["league.json"]
