#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (see docs/kda_gpu.md): installs carried wheels (.whl/,
# e.g. fla-core for the baseline), runs the Triton tests on the GPU, then bench/kda_gpu.py. Logs and the
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

# Budget: one device command runs at most 600 s. Tests get 180 s (mostly Triton compiles); the bench gets
# what is left up to 570 s, and rewrites its JSON after every case, so a cut-off run keeps what it measured.
timeout 180 python3 -m pytest tests/kda/test_triton.py -q -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

timeout $((570 - SECONDS)) python3 bench/kda_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "tests exit $tests_rc, bench exit $bench_rc (124 = stage timed out)"
exit $(( tests_rc != 0 || bench_rc != 0 ))
