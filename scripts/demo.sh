#!/usr/bin/env bash
# Sets up .venv and runs the main job: a 4-agent bucket_brigade team learns to fight fires (about
# 7 minutes on 2 CPU cores), then plays against every scripted archetype team and random play.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run_dir=runs/bucket_brigade-$(date +%Y%m%d-%H%M%S)
.venv/bin/phalanx train --env bucket_brigade --scenario default --seed 1 --run-dir "$run_dir" "$@"
.venv/bin/phalanx eval "$run_dir" --episodes 500 --vs firefighter,free_rider,hero,coordinator,liar,random
