"""Kept results packed: a study's run folders (each folder's JSON files: config.json, its evaluations, its summary)
as one gzipped JSON line a run, so that a study keeps one file where it kept a folder per run (issue 64).

    python -m bench.packs DIR PACK.jsonl.gz     # the run folders under DIR (the folders holding a config.json)

`runs(PACK)` reads the lines back as {"name", and each file by name}; `unpacked(PACK)` writes them back as folders in a
temporary directory, for the study scripts that read run folders (bench/games/study.py). A pack of the same runs is
the same bytes (no timestamp in it).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path


def is_pack(path: Path) -> bool:
    return path.name.endswith(".jsonl.gz")


def runs(root: Path) -> list[dict]:
    """Every run of a study: {"name", and each of its JSON files by file name}, from a pack or from a folder of run
    folders (any depth: the folders holding a config.json, in name order)."""
    if is_pack(root):
        with gzip.open(root, "rt") as f:
            return [json.loads(line) for line in f]
    return [{"name": cfg.parent.name, **{p.name: json.loads(p.read_text()) for p in sorted(cfg.parent.glob("*.json"))}}
            for cfg in sorted(root.rglob("config.json"))]


def pack(root: Path, out: Path) -> None:
    """The runs of `root` (`runs`) as one gzipped JSON line each, into `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        for run in runs(root):
            f.write((json.dumps(run, separators=(",", ":")) + "\n").encode())


@contextlib.contextmanager
def unpacked(pack_path: Path) -> Iterator[list[Path]]:
    """The runs of a pack as folders again (each file as it was, names kept), in a directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="pack-") as tmp:
        dirs = []
        for run in runs(pack_path):
            d = Path(tmp) / run["name"]
            d.mkdir()
            for name, content in run.items():
                if name != "name":
                    (d / name).write_text(json.dumps(content, indent=1) + "\n")
            dirs.append(d)
        yield dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="a folder of run folders")
    ap.add_argument("out", type=Path, help="the pack to write (NAME.jsonl.gz)")
    args = ap.parse_args()
    if not is_pack(args.out):
        ap.error("the pack's name must end in .jsonl.gz")
    pack(args.root, args.out)


if __name__ == "__main__":
    main()
