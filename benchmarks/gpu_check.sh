#!/usr/bin/env bash
# The one script for a GPU session: check and time the Pallas kernels, then
# measure training throughput.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, ~5-6 min on one H200
#   QUICK=1 bash benchmarks/gpu_check.sh    # each kernel's default config only, smaller probe
#
# 1. prints the GPU, python and jax versions;
# 2. makes `zeropp_jax` and `pallas_kernels` importable from this tree
#    (PYTHONPATH; `pip install --no-deps --no-build-isolation -e .` only if
#    that is not enough - nothing is fetched from the network);
# 3. runs the compiled half of tests/test_pallas_kernels.py
#    (PALLAS_KERNELS_COMPILED=1, `-k compiled`): every kernel compiled for the
#    GPU against its reference run by XLA on the GPU; the interpret-mode half
#    runs on CPU in CI;
# 4. runs benchmarks/gpu_kernels.py (verification on the GPU, then GB/s of
#    each kernel's default config and of a sweep, vs XLA vs a device copy);
# 5. runs benchmarks/gpu_train_probe.py (1.2B example GPT, bf16: plain jit,
#    plain with per-layer remat, zero3, qwz with its default kernels, with
#    Pallas only and with XLA only), saving
#    each variant's optimized HLO ($OUT/hlo, for benchmarks/step_traffic.py
#    --hlo-dir on any machine) and its device time per kernel from a
#    profiler trace of two more steps ($OUT/profile/<variant>.json, for
#    plain_remat, zero3 and qwz);
# 6. prints a short summary last: the pytest result line, both tables and
#    whether the step meets issue 18's goals (one "goal met / NOT met" line each).
#
# Logs and JSON go to $OUT (the device tool's output folder) or
# /tmp/zeropp_gpu_check. Each stage has its own time limit, so the whole
# script stays under ~9.5 minutes even if a stage hangs (the probe writes its
# JSON after every variant, so a limit keeps what it measured).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
LOG_DIR="${OUT:-/tmp/zeropp_gpu_check}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# GPU first (the default backend), CPU for the interpret-mode tests.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-180}"
PROBE_TIMEOUT="${PROBE_TIMEOUT:-240}"

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem \
  --format=csv,noheader 2>&1 | head -n 4
"$PY" - <<'EOF'
import sys
import jax
print("python", sys.version.split()[0], "| jax", jax.__version__, "| backend", jax.default_backend(),
      "|", [d.device_kind for d in jax.devices()])
EOF

echo "== imports"
if ! "$PY" -c "import zeropp_jax, pallas_kernels" 2>"$LOG_DIR/import.err"; then
  echo "not importable from the tree ($(tail -n 1 "$LOG_DIR/import.err")); trying an editable install"
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || true
  "$PY" -c "import zeropp_jax, pallas_kernels" || { echo "cannot import the packages"; exit 2; }
fi
echo "ok"

echo "== tests (compiled on GPU), limit ${TEST_TIMEOUT}s"
PALLAS_KERNELS_COMPILED=1 timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_pallas_kernels.py -k compiled -rfE 2>&1 | tee "$LOG_DIR/pytest.log"
TEST_RC=${PIPESTATUS[0]}

echo "== benchmark, limit ${BENCH_TIMEOUT}s"
BENCH_ARGS=(--json-out "$LOG_DIR/gpu_kernels.json")
if [[ "${QUICK:-0}" == "1" ]]; then BENCH_ARGS+=(--quick); fi
timeout "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_kernels.py "${BENCH_ARGS[@]}" 2>&1 | tee "$LOG_DIR/bench.log"
BENCH_RC=${PIPESTATUS[0]}

echo "== training probe, limit ${PROBE_TIMEOUT}s"
PROBE_ARGS=(--json-out "$LOG_DIR/gpu_train_probe.json" --hlo-dir "$LOG_DIR/hlo"
            --profile-dir "$LOG_DIR/profile")
if [[ "${QUICK:-0}" == "1" ]]; then PROBE_ARGS+=(--layers 12 --d-model 768 --heads 12); fi
timeout "$PROBE_TIMEOUT" "$PY" benchmarks/gpu_train_probe.py "${PROBE_ARGS[@]}" 2>&1 | tee "$LOG_DIR/probe.log"
PROBE_RC=${PIPESTATUS[0]}

echo
echo "== summary"
echo "pytest (rc=$TEST_RC): $(grep -E '(passed|failed|error)' "$LOG_DIR/pytest.log" | tail -n 1)"
grep -E '^FAILED|^ERROR' "$LOG_DIR/pytest.log" | head -n 12
echo "kernels (rc=$BENCH_RC):"
sed -n '/^JSON /,$p' "$LOG_DIR/bench.log" | tail -n +2
echo "training probe (rc=$PROBE_RC):"
sed -n '/^JSON /,$p' "$LOG_DIR/probe.log" | tail -n +2
if [[ $TEST_RC -ne 0 || $BENCH_RC -ne 0 || $PROBE_RC -ne 0 ]]; then exit 1; fi
