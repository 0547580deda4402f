#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (see docs/kda_gpu.md): installs carried wheels (.whl/,
# e.g. fla-core for the baseline), runs the Triton tests on the GPU, bench/ep_planner.py's planner section
# on CUDA (docs/ep.md), then bench/kda_gpu.py. Logs and the
# JSON go to $OUT (the device tool's return folder), or bench/results when OUT is unset.
# Stages are time-boxed so the whole run ends inside one 10-minute device command.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "carried wheels did not install; the baselines they provide will read n/a"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"

# Budget: one device command runs at most 600 s. Tests get 180 s (mostly Triton compiles), the EP planner
# 120 s; the KDA bench gets what is left up to 570 s. Both benches rewrite their JSON after every case, so
# a cut-off run keeps what it measured.
timeout 180 python3 -m pytest tests/kda/test_triton.py -q -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

# EP: the device planner's plan + slot map on CUDA, eager and captured in a CUDA graph (which fails if it
# syncs), against the host oracle and MoonEP's greedy; R = 64, 128, 256 at E = 896. Prints a skip and
# exits 0 when torch sees no CUDA device. Writes $OUT/ep_planner_cuda.json.
timeout 120 python3 bench/ep_planner.py --section planner --device cuda --repeats 50 --out "$OUT" 2>&1 \
  | tee "$OUT/ep_planner.log"
ep_rc=${PIPESTATUS[0]}

timeout $((570 - SECONDS)) python3 bench/kda_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "tests exit $tests_rc, ep planner exit $ep_rc, bench exit $bench_rc (124 = stage timed out)"
exit $(( tests_rc != 0 || ep_rc != 0 || bench_rc != 0 ))
