"""The `phalanx` command (its console script and `python -m phalanx`)."""

import gc
import sys

# Importing torch makes about a million objects and no garbage: the collections it would trigger cost
# 0.4 s of a 20-second training run, and every later full collection would walk those objects again
# (#27). Imported with the collector off, then frozen out of its reach; nothing of ours relies on it.
gc.disable()
from phalanx import cli  # noqa: E402

gc.freeze()
gc.enable()


def run() -> None:
    """`cli.main`, then exit with its status."""
    code = cli.main()
    # Python's last collection at exit walks what the run made since: frozen, it is skipped (0.75 s, #27).
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
