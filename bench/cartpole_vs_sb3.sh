#!/usr/bin/env bash
# Phalanx vs. a minimal pure-torch PPO vs. Stable-Baselines3 on CartPole (see bench/README.md).
# Extra arguments go to `phalanx bench cartpole`, e.g. --threads 1 or --json results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PHALANX=phalanx
if [ -x .venv/bin/phalanx ]; then PHALANX=.venv/bin/phalanx; fi
exec "$PHALANX" bench cartpole --sb3 --wait-idle 60 "$@"
