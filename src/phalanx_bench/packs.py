"""Kept results packed: a study's run folders (each folder's JSON files: config.json, its evaluations, its summary;
and a JSON-lines file such as metrics.jsonl where asked) as one gzipped JSON line a run, so that a study keeps one
file where it kept a folder per run (issue 64).

    python -m phalanx_bench.packs DIR PACK.jsonl.gz     # the run folders under DIR (the folders holding a config.json)
    python -m phalanx_bench.packs DIR PACK.jsonl.gz --runs '*/result.json'    # DIR's folders holding a result.json
    python -m phalanx_bench.packs DIR PACK.jsonl.gz --runs '*/sweep.json' --files '*.json' --files 'eval/*.json'
    python -m phalanx_bench.packs DIR PACK.jsonl.gz --files '*.json' --files metrics.jsonl   # with each run's curve: its rows

`runs(PACK)` reads the lines back as {"name", and each file by name}; `unpacked(PACK)` writes them back as folders in a
temporary directory, for the study scripts that read run folders (phalanx_bench/studies/games.py). A pack of the same runs is
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


RUNS = "**/config.json"  # a run folder: one holding a config.json, at any depth
FILES = ("*.json",)  # what of a run folder is kept: its JSON files


def read(path: Path) -> object:
    """A kept file's content: a JSON file's value, or a JSON-lines file's rows as a list."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def text(name: str, content: object) -> str:
    """A kept file written out again: JSON-lines rows one a line, as a run writes them; JSON indented."""
    if name.endswith(".jsonl"):
        return "".join(json.dumps(row) + "\n" for row in content)
    return json.dumps(content, indent=1) + "\n"


def runs(root: Path, marker: str = RUNS, files: tuple[str, ...] = FILES) -> list[dict]:
    """Every run of a study: {"name", and each of its files by its path in the run folder (`read`)}, from a pack or
    from a folder of run folders (the folders holding a file that `marker`, a glob under `root`, matches: by default
    any depth's config.json; in name order; of each, the files that a glob of `files` matches: by default its JSON
    files)."""
    if is_pack(root):
        with gzip.open(root, "rt") as f:
            return [json.loads(line) for line in f]
    return [{"name": d.name, **{p.relative_to(d).as_posix(): read(p)
                                for p in sorted({p for glob in files for p in d.glob(glob)})}}
            for d in sorted({p.parent for p in root.glob(marker)})]


def pack(root: Path, out: Path, marker: str = RUNS, files: tuple[str, ...] = FILES) -> None:
    """The runs of `root` (`runs`) as one gzipped JSON line each, into `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        for run in runs(root, marker, files):
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
                    (d / name).parent.mkdir(parents=True, exist_ok=True)
                    (d / name).write_text(text(name, content))
            dirs.append(d)
        yield dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="a folder of run folders")
    ap.add_argument("out", type=Path, help="the pack to write (NAME.jsonl.gz)")
    ap.add_argument("--runs", default=RUNS, help=f"a glob under ROOT: the folders holding a file it matches are the "
                    f"runs [{RUNS}]")
    ap.add_argument("--files", action="append", help=f"a glob under each run folder: the files it matches are kept "
                    f"(again for more) [{', '.join(FILES)}]")
    args = ap.parse_args()
    if not is_pack(args.out):
        ap.error("the pack's name must end in .jsonl.gz")
    pack(args.root, args.out, args.runs, tuple(args.files or FILES))


if __name__ == "__main__":
    main()
