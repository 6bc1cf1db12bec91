"""Data-parallel training under torchrun on CPU (gloo): identical ranks, global step counts, resume."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from phalanx import checkpoint as ckpt

WORKER = Path(__file__).parent / "ddp_worker.py"


def torchrun(*args: str, out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), *args, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        # A rank aborting in C++ (seen twice in ~12 full runs on a loaded 2-core machine, never alone;
        # faulthandler in the worker prints where): the run is repeated once, every check still applies.
        print("torchrun: a rank aborted; repeating the run once\n" + proc.stderr[-4000:], file=sys.stderr)
        if args[0] != "resume":  # a fresh run starts over; a resume goes on from its latest checkpoint
            shutil.rmtree(args[1], ignore_errors=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def ranks(out: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)]


@pytest.mark.slow
def test_two_processes_stay_identical_count_all_steps_and_resume(tmp_path):
    full_out, part_out = tmp_path / "full_out", tmp_path / "part_out"
    full_out.mkdir()
    part_out.mkdir()
    torchrun("full", str(tmp_path / "full"), out=full_out)
    a, b = ranks(full_out)
    assert a.keys() == b.keys()
    for k in a:  # gradients and statistics are shared, so ranks never drift apart
        assert torch.equal(a[k], b[k]), k
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [512, 1024, 1536, 2048]  # 2 ranks x 4 envs x 64 steps per update
    meta = json.loads((ckpt.latest_checkpoint(tmp_path / "full") / "meta.json").read_text())
    assert meta["world_size"] == 2

    torchrun("part", str(tmp_path / "part"), out=part_out)
    assert ckpt.latest_checkpoint(tmp_path / "part").name == f"step_{1024:012d}"
    torchrun("resume", str(tmp_path / "part"), out=part_out)
    c, _ = ranks(part_out)
    for k in a:  # the stopped-and-resumed run continues exactly as the uninterrupted one
        assert torch.equal(a[k], c[k]), k
    rows = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3, 4]

    import phalanx
    from phalanx.errors import CheckpointError

    with pytest.raises(CheckpointError, match="written by 2 processes"):
        phalanx.train(resume=tmp_path / "part", total_steps=4096)
