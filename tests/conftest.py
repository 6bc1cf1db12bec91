import json
import os

import pytest
import torch

# Two cores on CI, shared with the other xdist worker: one thread per worker avoids oversubscription.
torch.set_num_threads(1)
# ... and each worker on a CPU of its own, so that a trainer choosing its threads from the work
# (devices.choose_threads) finds one CPU, as do the CLI runs the tests start.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cpus[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_cpus)]})
os.environ.setdefault("MPLBACKEND", "Agg")

from phalanx.cli import main  # noqa: E402  (after the backend is chosen above)


@pytest.fixture(autouse=True)
def one_torch_thread():
    # A trainer with torch_threads 0 picks the count from its batch (devices.choose_threads): back to one
    # after each test, so a large-batch test leaves no pool behind for the worker's next tests.
    yield
    torch.set_num_threads(1)


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def printed_config(capsys):
    """`phalanx train --env ENV FLAGS --print-config` read back: {key: (value, the layer it came from)}."""
    def printed(env: str, *flags: str) -> dict:
        assert main(["train", "--env", env, *flags, "--print-config"]) == 0
        rows = {}
        for line in capsys.readouterr().out.splitlines():
            key, rest = line.split("=", 1)
            value, source = rest.rsplit("  # ", 1)
            rows[key.strip()] = (json.loads(value), source)
        return rows

    return printed
