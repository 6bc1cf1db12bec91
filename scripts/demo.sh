#!/usr/bin/env bash
# Sets up .venv and runs the main job: a short training run that visibly learns, then its evaluation.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run_dir=runs/demo-$(date +%Y%m%d-%H%M%S)
.venv/bin/phalanx train --env cartpole --seed 1 --eval-episodes 20 --run-dir "$run_dir" "$@"
.venv/bin/phalanx eval "$run_dir" --episodes 20
