import os

import pytest
import torch

# Two cores on CI, shared with the other xdist worker: one thread per worker avoids oversubscription.
torch.set_num_threads(1)
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"
