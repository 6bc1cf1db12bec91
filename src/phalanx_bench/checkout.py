"""The checkout's bench/ folder: the specs the studies read (bench/parity/, the sweep YAMLs) and the results they keep
(bench/results/). The studies run from a clone of the repository (installed with `pip install -e .`); installed
from a wheel, where the package has no bench/ beside it, the folder is bench/ under the working directory."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parents[2] / "bench"  # src/phalanx_bench/checkout.py -> the repository's bench/
BENCH = _HERE if (_HERE / "README.md").is_file() else Path("bench")
RESULTS = BENCH / "results"
