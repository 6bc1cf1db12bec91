#!/usr/bin/env bash
# Phalanx on a CUDA machine without internet access, over the machine's own PyTorch: installs the
# project (no dependencies fetched; wheels it lacks come from WHEELS, default .whl/), then runs the
# stages named on the command line and writes every log and figure to RESULTS (default gpu-results/).
#
#   bench/gpu.sh setup tests suite solve       # stages: setup info tests refail compile fastest graphs suite memory_league cartpole solve bucket bucket_eager vmas
#
# Wheels to carry for a machine that has torch but not the rest (from a machine with pip access):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#       openskill gymnasium farama-notifications pettingzoo mpe2 pygame-ce stable-baselines3
# and for the vmas stage (vmas, gym and antlr4 ship no wheels: build them with `pip wheel --no-deps -w .whl`;
# torchrl's and tensordict's wheels must be the builds for the machine's torch):
#       vmas gym gym-notices pyglet==1.5.27 six benchmarl torchrl tensordict hydra-core omegaconf
#       antlr4-python3-runtime==4.9.3 pyvers orjson cloudpickle
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-${OUT:-gpu-results}}
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
PHX="$PY -m phalanx"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

stage_setup() {
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/phalanx-site "$WHEELS"/*.whl || return 1
        export PYTHONPATH=/tmp/phalanx-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    $PY -c "import phalanx, torch; print('phalanx', phalanx.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
}

stage_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$RESULTS/gpu.txt"
    $PY -c "import torch, platform; print(torch.__version__, torch.version.cuda, platform.python_version(), torch.cuda.get_device_properties(0))" | tee -a "$RESULTS/gpu.txt"
}

stage_tests() {  # the whole suite with CUDA as the default device ('auto'); CUDA-only tests run, not skip
    # The per-test limit stays above the slowest tests' own time (the kill-9 storm: 241 s on 2 CPU cores).
    timeout "${TEST_SECONDS:-450}" $PY -m pytest -v -n "${TEST_WORKERS:-12}" -o cache_dir=/tmp/phalanx-pytest-cache \
        --timeout "${TEST_TIMEOUT:-420}" -rfEs --durations=25 --junitxml="$RESULTS/junit.xml" >"$RESULTS/tests_full.log" 2>&1
    local rc=$?
    grep -E "FAILED|ERROR|passed|failed|^[0-9.]+s (call|setup)" "$RESULTS/tests_full.log" | grep -v "^tests/" | tail -n 80 \
        | tee "$RESULTS/tests.log"
    return $rc
}

stage_refail() {  # the tests the last `tests` stage failed, again with few workers (contention or a real failure?)
    timeout "${REFAIL_SECONDS:-120}" $PY -m pytest -q -n "${REFAIL_WORKERS:-2}" -o cache_dir=/tmp/phalanx-pytest-cache \
        --last-failed --last-failed-no-failures none --timeout 100 -rfE 2>&1 | tail -n 40 | tee "$RESULTS/refail.log"
}

stage_compile() {  # --compile on cartpole at 64k envs beside eager and CUDA graphs; inductor compiles in this process, so
    # a failure shows its own message rather than "An exception occurred in a subprocess"
    TORCHINDUCTOR_COMPILE_THREADS=1 timeout "${COMPILE_SECONDS:-150}" $PHX bench suite --device cuda --workloads cartpole \
        --num-envs "${COMPILE_ENVS:-65536}" --modes eager,compile,graphs --seconds "${BENCH_SECONDS:-2}" --no-profile --uncapped \
        --out /tmp/phalanx-compile --json "$RESULTS/compile.json" 2>&1 | tee "$RESULTS/compile.log"
}

stage_fastest() {  # the fastest modes against the targets (cartpole >= 25M, bucket_brigade >= 20M at 64k envs)
    local limit=${FASTEST_SECONDS:-240}
    [ -n "${DEADLINE:-}" ] && limit=$((DEADLINE - SECONDS))  # DEADLINE: seconds since the script started
    [ "$limit" -ge 60 ] || { echo "fastest: ${limit} s left, not started"; return 1; }
    TORCHINDUCTOR_COMPILE_THREADS=1 timeout "$limit" $PHX bench suite --device cuda \
        --workloads "${FASTEST_WORKLOADS:-cartpole,bucket_brigade}" --num-envs "${FASTEST_ENVS:-65536}" \
        --modes "${FASTEST_MODES:-eager,graphs+bf16,compile+bf16}" --seconds "${BENCH_SECONDS:-2}" --no-profile --uncapped \
        --out /tmp/phalanx-fastest --json "$RESULTS/fastest.json" 2>&1 | tee "$RESULTS/fastest.log"
}

stage_graphs() {  # the CUDA-only tests alone, verbose
    $PY -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda.py tests/test_envs_classic.py -k "cuda or gpu" 2>&1 \
        | tail -n 60 | tee "$RESULTS/cuda_tests.log"
}

stage_retest() {  # named tests only (RETEST), e.g. the ones a full run failed; each test's outcome by name, as it ends
    timeout "${TEST_SECONDS:-200}" $PY -m pytest -v -n "${TEST_WORKERS:-8}" -p no:cacheprovider --timeout "${RETEST_TIMEOUT:-180}" -rfE $RETEST 2>&1 \
        | grep --line-buffered -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" | tee "$RESULTS/retest.log"
}

stage_suite() {  # every workload at 4k / 16k / 64k envs
    timeout "${SUITE_SECONDS:-400}" $PHX bench suite --device cuda --num-envs "${SUITE_ENVS:-4096,16384,65536}" \
        --seconds "${BENCH_SECONDS:-2}" --no-profile --uncapped --out "$RESULTS/suite" --json "$RESULTS/suite.json" ${SUITE_ARGS:-} \
        2>&1 | tee "$RESULTS/suite.log"
}

stage_memory_league() {  # issue 28's rows: the transformer (KV cache) and the duel league, eager and --cuda-graphs
    timeout "${MEMORY_LEAGUE_SECONDS:-300}" $PHX bench suite --device cuda --workloads trial_nav,duel \
        --num-envs "${MEMORY_LEAGUE_ENVS:-4096,16384,65536}" --modes eager,graphs --seconds "${BENCH_SECONDS:-2}" --no-profile \
        --uncapped --out "$RESULTS/memory_league" --json "$RESULTS/memory_league.json" 2>&1 | tee "$RESULTS/memory_league.log"
}

stage_cartpole() {  # eager, --compile and the minimal loop in turns, one process
    timeout "${CARTPOLE_SECONDS:-300}" $PHX bench cartpole --device cuda --num-envs "${CARTPOLE_ENVS:-4096,16384,65536}" \
        --steps 32 --seconds "${BENCH_SECONDS:-2}" --compile ${CARTPOLE_ARGS:-} --json "$RESULTS/cartpole.json" 2>&1 | tee "$RESULTS/cartpole.log"
}

solve() {  # solve NAME ARGS...: wall-clock of the whole `phalanx train` process, then greedy/sampled eval
    local name=$1; shift
    local run="$RESULTS/runs/$name"
    rm -rf "$run"
    local t0 t1
    t0=$(date +%s.%N)
    timeout "${SOLVE_SECONDS:-300}" $PHX train --device cuda --run-dir "$run" --progress false --tensorboard false "$@" >"$RESULTS/$name.train.log" 2>&1
    local rc=$?
    t1=$(date +%s.%N)
    echo "$name: train rc $rc, wall $($PY -c "print(round($t1 - $t0, 1))") s: $*" | tee -a "$RESULTS/solve.txt"
    $PHX eval "$run" --episodes "${EVAL_EPISODES:-100}" --device cuda ${EVAL_ARGS:-} 2>&1 | tee -a "$RESULTS/solve.txt"
}

stage_solve() {  # cartpole to greedy 475: its default config, eager and with CUDA graphs
    solve cartpole_eager --env cartpole --seed 1
    solve cartpole_graphs --env cartpole --seed 1 --cuda-graphs true
}

stage_solve_graphs() {
    solve cartpole_graphs --env cartpole --seed 1 --cuda-graphs true
}

stage_vmas() {  # Phalanx against BenchMARL MAPPO on VMAS (BenchMARL's 10M frames, which its collector rounds up to 167 batches)
    $PY -m phalanx_bench.studies.vmas_vs_benchmarl --device cuda --tasks "${VMAS_TASKS:-navigation,balance}" --seeds "${VMAS_SEEDS:-1,2}" \
        --frames "${VMAS_FRAMES:-10020000}" --eval-every "${VMAS_EVAL:-1200000}" --out "$RESULTS/vmas_vs_benchmarl" \
        2>&1 | grep -v "it/s" | tail -n 30 | tee "$RESULTS/vmas.log"
}

stage_bucket() {  # bucket_brigade above the best archetype team (hero 880.57 at seed 1 on CPU)
    EVAL_EPISODES=500 EVAL_ARGS="--vs firefighter,hero" solve bucket_graphs --env bucket_brigade --scenario default --seed 1 --cuda-graphs true
}

stage_bucket_eager() {
    EVAL_EPISODES=500 EVAL_ARGS="--vs firefighter,hero" solve bucket_eager --env bucket_brigade --scenario default --seed 1
}

for s in "$@"; do
    echo "== stage $s ($(date +%T))"
    "stage_$s" || echo "== stage $s failed"
done
