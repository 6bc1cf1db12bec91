#!/usr/bin/env bash
# Sets up .venv and runs the test suite on all cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The Node.js example's test (tests/test_export_js.py) runs where node is: onnxruntime-node from the npm registry, its
# shipped CPU build (the variable skips the install script's download from elsewhere). Without npm the test skips.
if command -v npm >/dev/null 2>&1 && [ ! -d examples/onnx_play_js/node_modules/onnxruntime-node ]; then
  ONNXRUNTIME_NODE_INSTALL=skip npm install --prefix examples/onnx_play_js --no-audit --no-fund --silent \
    || echo "scripts/test.sh: npm install in examples/onnx_play_js failed; tests/test_export_js.py will skip" >&2
fi
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-auto}" "$@"
