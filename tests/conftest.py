import os

import pytest
import torch

# Two cores on CI, shared with the other xdist worker: one thread per worker avoids oversubscription.
torch.set_num_threads(1)
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def one_torch_thread():
    # A trainer with torch_threads 0 picks the count from its batch (runs.choose_threads): back to one
    # after each test, so a large-batch test leaves no pool behind for the worker's next tests.
    yield
    torch.set_num_threads(1)


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"
