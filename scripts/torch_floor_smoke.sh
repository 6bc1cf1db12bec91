#!/usr/bin/env bash
# The smoke behind the torch floor (README, "Versions"): install a torch into a scratch venv beside Phalanx and
# run the core path (train, eval, resume, check-env; a league; both memory models), then --compile.
#   bash scripts/torch_floor_smoke.sh 2.4.1 [/tmp/floor-2.4.1]
# It downloads that torch from PyPI (a CUDA build on Linux x86_64: about 3 GB): not part of the test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?torch version, e.g. 2.4.1}
VENV=${2:-/tmp/phalanx-torch-$VERSION}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$VERSION" || exit 3
# --no-deps: Phalanx's own floor would otherwise move this venv's torch; its other deps come next.
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e . || exit 3
"$VENV/bin/pip" install --quiet --disable-pip-version-check "numpy>=1.24" "safetensors>=0.4" "tensorboard>=2.14" "rich>=13" \
  "matplotlib>=3.7" "pyyaml>=6" "gymnasium>=1.0" "openskill>=6" "tomli>=2; python_version < '3.11'" "torch==$VERSION" || exit 3
OUT=$(mktemp -d)
P="$VENV/bin/phalanx"
ok=0; failed=0
step() {  # step NAME CMD...: run it, one line of result
  local name=$1; shift
  if "$@" >"$OUT/$name.log" 2>&1; then echo "ok      $name"; ok=$((ok + 1))
  else echo "FAILED  $name (exit $?): $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-200)"; failed=$((failed + 1)); fi
}
common=(--progress false --torch-threads 1 --eval-episodes 0)
echo "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), python $("$VENV/bin/python" -V 2>&1)"
step check-env    "$P" check-env cartpole
step train        "$P" train --env cartpole --total-steps 8192 --run-dir "$OUT/cp" "${common[@]}"
step eval         "$P" eval "$OUT/cp" --episodes 5 --torch-threads 1
step resume       "$P" resume "$OUT/cp" --total-steps 12288
step league       "$P" train --env duel --opponents self_play:1,constant:1 --num-envs 8 --num-steps 64 --total-steps 1024 --run-dir "$OUT/duel" "${common[@]}"
step lstm         "$P" train --env trial_nav --model lstm --num-envs 8 --num-steps 64 --total-steps 1024 --run-dir "$OUT/lstm" "${common[@]}"
step transformer  "$P" train --env trial_nav --model transformer --num-envs 8 --num-steps 64 --total-steps 1024 --run-dir "$OUT/tf" "${common[@]}"
step multi-agent  "$P" train --env bucket_brigade --num-envs 8 --num-steps 64 --total-steps 1024 --run-dir "$OUT/bb" "${common[@]}"
step compile      "$P" train --env cartpole --compile true --num-envs 8 --num-steps 64 --total-steps 1024 --run-dir "$OUT/cc" "${common[@]}"
echo "$ok ok, $failed failed (logs in $OUT)"
[ "$failed" -eq 0 ]
