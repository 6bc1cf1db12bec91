#!/usr/bin/env bash
# Creates .venv (if needed) and installs Phalanx with its test extras.
# TORCH_SPEC picks the torch build (default torch==2.13.0; e.g. TORCH_SPEC=torch for the newest).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install --quiet --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test${EXTRAS:+,$EXTRAS}]"
