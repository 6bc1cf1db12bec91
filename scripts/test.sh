#!/usr/bin/env bash
# Sets up .venv and runs the test suite on all cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-auto}" "$@"
